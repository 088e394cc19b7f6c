"""A train worker of the async trainer killed in the middle of a step (SIGKILL): Ray Train restarts the
worker group (``ray.max_failures``), the restarted workers load the last committed checkpoint, and the
controller drops its rollout stream and streams again from that checkpoint.

The same fault in the synchronous trainers is tested where their straight runs are:
``tests/ray/test_resume_exact.py`` (AR GRPO, 2 ranks) and ``tests/ray/test_e2e_sft.py`` (SFT)."""

import pytest
from support import kill_rank, logged, make, recipe_path

from unirl_ray.trainer.async_rl import AsyncARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


def test_async_trainer_restarts_its_rollout_stream_after_a_worker_death(ray_local, tmp_path):
    """Async GRPO: the worker is killed while step 5 trains (checkpoint at 3). The controller drops the
    stream (its batches were for steps that run again), republishes the checkpoint's weights and
    streams again from the checkpoint's data cursor; staleness and no-double-training checks hold."""
    steps = 5
    trainer = make(AsyncARTrainer, recipe_path("ar", "tiny", "char_grpo_async.yaml"), tmp_path, "async-killed",
                   f"trainer.num_steps={steps}", "trainer.checkpoint_every=3", "tracking.log_samples_every=0",
                   "++ray.max_failures=1", experiment="faults")
    killed, versions, original = [], {}, trainer.train

    def train(samples, *, seed):
        step = trainer.prompt_log[-1][0]
        versions.setdefault(step, []).append((trainer.policy_version, [s.policy_version for s in samples]))
        if step == steps and not killed:
            killed.append(kill_rank(trainer, 0))
        return original(samples, seed=seed)

    trainer.train = train
    trainer.fit()
    assert killed and trainer.restarts == 1 and trainer.policy_version == steps
    assert [len(versions[s]) for s in range(1, steps + 1)] == [1, 1, 1, 2, 2]  # 4 and 5 trained again
    for attempts in versions.values():
        for weights, sample_versions in attempts:
            assert all(0 <= weights - v <= 1 for v in sample_versions)
    assert versions[4][1][0] == 3  # the replayed step 4 trains on the checkpoint's weights (v3)
    assert sorted(logged(trainer, "reward/mean")) == list(range(1, steps + 1))
