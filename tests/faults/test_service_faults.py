"""Serve-side faults: a reward replica that dies is routed around and replaced while the client
retries (bounded, with back-off); a rollout call that never answers fails with a clear error after
its timeout and bounded retries, never an endless wait."""

import time

import numpy as np
import pytest

from unirl_ray.core.sample import Sample


def samples(n):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        s = Sample(sample_id=f"s0-{i}", group_id="g", prompt="p")
        s.image = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
        out.append(s)
    return out


@pytest.mark.ray
def test_reward_replica_killed_between_calls_is_retried_and_replaced(ray_local):
    import ray

    from unirl_ray.rewards import RewardClient, RewardConfig

    def replicas():
        return sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
                      if "SERVE_REPLICA" in a["name"] and "fault-reward" in a["name"])

    cfg = RewardConfig.from_dict({"rewards": {"brightness": {"fn": "unirl_ray.rewards.image.brightness"}},
                                  "max_retries": 4, "timeout_s": 30, "num_replicas": 1, "placement": "serve",
                                  "ray_actor_options": {"num_cpus": 0.25}})
    client = RewardClient.deploy(cfg, app_name="fault-reward", ready_timeout_s=120)
    try:
        before = client.score(samples(4))
        old = replicas()
        assert len(old) == 1, old
        ray.kill(ray.get_actor(old[0][0], namespace=old[0][1]), no_restart=True)  # as a crash would
        t0 = time.monotonic()
        after = client.score(samples(4))  # the first attempt may hit the dead replica: retried
        assert after["reward/mean"] == pytest.approx(before["reward/mean"])
        assert time.monotonic() - t0 < 60
        deadline = time.monotonic() + 60
        while replicas() in ([], old) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert replicas() and replicas() != old  # Serve replaced it
    finally:
        client.shutdown()


class NeverAnswers:
    """A Serve response whose replica hangs: every ``result(timeout_s)`` waits out the timeout."""

    calls = 0

    def result(self, timeout_s):
        NeverAnswers.calls += 1
        time.sleep(min(timeout_s, 0.2))
        raise TimeoutError(f"no answer within {timeout_s}s")


class HangingHandle:
    class generate:  # noqa: N801 - mirrors handle.generate.remote
        @staticmethod
        def remote(*args):
            return NeverAnswers()


def test_hung_rollout_call_fails_after_its_timeout_and_bounded_retries(monkeypatch):
    from unirl_ray.rollout.dedicated import DedicatedEngine, DedicatedRollout

    monkeypatch.setattr(time, "sleep", lambda s: None if s > 0.5 else time.perf_counter())  # skip the back-off
    engine = DedicatedEngine(DedicatedRollout(timeout_s=0.2, max_retries=2), "hung", HangingHandle(), store=None)
    engine.version = 3
    NeverAnswers.calls = 0
    with pytest.raises(RuntimeError, match="rollout engine call failed after 3 attempts: .*no answer within 0.2s"):
        engine.generate([{"sample_id": "s1-0", "prompt": "p", "seed": 0}])
    assert NeverAnswers.calls == 3
