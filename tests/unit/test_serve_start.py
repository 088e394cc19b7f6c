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


def test_apps_built_in_parallel_threads_do_not_break_each_others_serialization():
    """Ray Serve registers a module for pickle-by-value in cloudpickle's process-wide registry while it builds a
    deployment's config, and unregisters it after: a reward app and a rollout engine built at once in two
    threads failed a run's start ("... is not registered for pickle by value"; 99 of 400 builds in 4 threads
    without ``runtime.serve.serve_build``). Built here by the trainer's own builders, in 4 threads at once; a build
    that waits longer than its timeout for another one's is refused with a TimeoutError naming it."""
    from unirl_ray.rewards.service import RewardConfig, build_reward_app
    from unirl_ray.rollout.dedicated import DedicatedRollout, engine_app

    reward = RewardConfig(rewards={"bright": {"fn": "unirl_ray.rewards.image.brightness"}})
    errors: list[BaseException] = []

    def build(which: int) -> None:
        for _ in range(60):
            try:
                if which % 2:
                    build_reward_app(reward)
                else:
                    engine_app(DedicatedRollout(), sections={}, seed=0, app_name="race")
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors, errors[:2]

    from unirl_ray.runtime.serve import serve_build

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with serve_build("the holder"):
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        try:
            with serve_build("the reward app", timeout_s=0.1):
                raise AssertionError("entered a build another thread holds")
        except TimeoutError as exc:
            assert str(exc).startswith("the reward app: another Serve app's build"), exc
    finally:
        release.set()
        holder.join(10)
    with serve_build("after", timeout_s=1):  # released: free again
        pass
