"""The reward service as a real Serve app: scores, failure policy, timeouts, replicas."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from ray import cloudpickle

from unirl_ray.core.sample import Sample
from unirl_ray.rewards import RewardApp, RewardClient, RewardConfig, RewardError, brightness, jpeg_compressibility

# Reward fns below live in this test module, which Serve replicas cannot import: ship them by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def boom(*, images, prompts, **columns):
    raise RuntimeError("reward model exploded")


def sleepy(*, images, prompts, **columns):
    time.sleep(30.0)
    return [1.0] * len(prompts)


def nan_odd(*, images, prompts, **columns):
    return [float("nan") if i % 2 else 0.5 for i in range(len(prompts))]


def by_answer(*, images, prompts, answer, **columns):
    return [float(a) for a in answer]


def _samples(n: int, size: int = 16) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        img = rng.integers(0, 256, (size, size, 3), dtype=np.uint8) if i % 2 else np.full((size, size, 3), 20 * i, np.uint8)
        out.append(Sample(sample_id=f"s0-{i}", group_id=f"g{i // 2}", prompt=f"p{i}", image=img, columns={"answer": i}))
    return out


ALL_REWARDS = {
    "brightness": {"fn": "unirl_ray.rewards.image.brightness", "weight": 1.0},
    "jpeg": {"fn": "unirl_ray.rewards.image.jpeg_compressibility", "weight": 0.1},
    "answer": {"fn": by_answer, "weight": 1.0},
    "nan_log_only": {"fn": nan_odd, "weight": 0.0},
    "boom": {"fn": boom, "weight": 0.5},
    "sleepy": {"fn": sleepy, "weight": 1.0},
}


@pytest.fixture(scope="module")
def reward_app(ray_local):
    """One Serve app with every test reward on 2 replicas (rule rewards would run locally by default); each
    test's client asks for a subset of sources."""
    cfg = RewardConfig.from_dict({"rewards": ALL_REWARDS, "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25},
                                  "placement": "serve"})
    client = RewardClient.deploy(cfg, app_name="reward-test", ready_timeout_s=120)
    yield client
    client.shutdown()


def _client(app: RewardClient, names: list[str], **policy) -> RewardClient:
    """A client for a subset of the app's sources with its own policy (policy is applied client-side)."""
    cfg = RewardConfig.from_dict({"rewards": {n: ALL_REWARDS[n] for n in names}, **policy})
    return RewardClient([RewardApp(app.apps[0].handle, cfg, app.app_name)], cfg)


def test_scores_weights_and_replicas(reward_app):
    client = _client(reward_app, ["brightness", "jpeg", "answer", "nan_log_only"], num_replicas=2)
    samples = _samples(5)
    metrics = client.score(samples)
    images = [s.image for s in samples]
    want_b = brightness(images=images, prompts=[""] * 5)
    want_j = jpeg_compressibility(images=images, prompts=[""] * 5)
    for i, s in enumerate(samples):
        assert s.rewards["brightness"] == pytest.approx(want_b[i])
        assert s.rewards["jpeg"] == pytest.approx(want_j[i])
        assert s.rewards["answer"] == float(i)
        assert s.rewards["nan_log_only"] == (None if i % 2 else 0.5)
        assert s.reward == pytest.approx(want_b[i] + 0.1 * want_j[i] + i)
    assert metrics["reward/invalid_frac"] == 0.0
    assert metrics["reward/brightness/mean"] == pytest.approx(np.mean(want_b))
    assert metrics["reward/mean"] == pytest.approx(np.mean([s.reward for s in samples]))
    for key in ("reward/std", "reward/jpeg/std", "timing/reward", "timing/reward/jpeg", "reward/retries"):
        assert key in metrics


def test_connect_to_running_app(reward_app):
    other = RewardClient.connect("reward-test")
    assert other.config.weights == reward_app.config.weights
    assert set(other.config.rewards) == set(ALL_REWARDS)


def test_failing_reward_fail_and_skip(reward_app, caplog):
    fail = _client(reward_app, ["brightness", "boom"], on_error="fail", max_retries=1)
    with pytest.raises(RewardError, match=r"'boom'.*RuntimeError: reward model exploded.*2 attempt") as info:
        fail.score(_samples(3))
    assert info.value.reward == "boom"

    skip = _client(reward_app, ["brightness", "boom"], on_error="skip", max_retries=1)
    samples = _samples(3)
    with caplog.at_level("WARNING", logger="unirl_ray.rewards.service"):
        metrics = skip.score(samples)
    assert all(s.rewards["boom"] is None and s.reward is None for s in samples)
    assert samples[0].rewards["brightness"] == pytest.approx(0.0)
    assert metrics["reward/invalid_frac"] == 1.0 and metrics["reward/skipped"] == 1.0
    assert metrics["reward/retries"] == 1.0
    assert "boom" in caplog.text and "skipped" in caplog.text


def test_slow_reward_times_out_not_hangs(reward_app):
    fail = _client(reward_app, ["brightness", "sleepy"], timeout_s=1.0, max_retries=0)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"'sleepy'.*did not finish within timeout_s=1 s") as info:
        fail.score(_samples(2))
    assert time.monotonic() - start < 20.0  # the fn sleeps 30 s: no hang
    assert info.value.reward == "sleepy"

    skip = _client(reward_app, ["brightness", "sleepy"], timeout_s=1.0, max_retries=0, on_error="skip")
    samples = _samples(2)
    skip.score(samples)
    assert [s.rewards["sleepy"] for s in samples] == [None, None]
    assert samples[0].rewards["brightness"] == pytest.approx(0.0)


def test_app_builder_cli_args():
    from ray.serve import Application

    from serve_apps.reward_app import _parse_rewards, app_builder

    assert _parse_rewards("brightness, jpeg_compressibility") == {
        "brightness": {"fn": "unirl_ray.rewards.image.brightness", "weight": 1.0},
        "jpeg_compressibility": {"fn": "unirl_ray.rewards.image.jpeg_compressibility", "weight": 1.0},
    }
    app = app_builder({"rewards": "{b: {fn: unirl_ray.rewards.image.brightness, weight: 2}}", "timeout_s": "30"})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="rewards"):
        app_builder({})
