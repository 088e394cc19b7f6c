"""``runtime.serve.start_serve`` from parallel threads (a reward app and a rollout engine deploying at
the same time) starts Serve once at a time: two concurrent ``serve.start`` calls on a cluster without
Serve would both try to create the controller actor, and one fails (``ActorAlreadyExistsError``)."""

import threading
import time


def test_concurrent_starts_are_serialised(monkeypatch):
    from ray import serve

    from unirl_ray.runtime.serve import start_serve

    inside, most, calls = [0], [0], []

    def fake_start(**kwargs):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.05)
        calls.append(kwargs)
        inside[0] -= 1

    monkeypatch.setattr(serve, "start", fake_start)
    threads = [threading.Thread(target=start_serve) for _ in range(3)]
    threads.append(threading.Thread(target=start_serve, kwargs={"http_port": 8123}))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert most[0] == 1 and len(calls) == 4
    assert calls.count({"proxy_location": "Disabled"}) == 3
