"""A train worker killed in the middle of a step (SIGKILL, 2 FSDP2 ranks over gloo): Ray Train restarts
the worker group (``ray.max_failures``), the restarted workers load the last committed checkpoint, the
controller rewinds to it and runs the lost steps again. At the end the run equals an uninterrupted
one: the same steps, prompts and numbers, one MLflow run, the restart counted."""

import os
import signal

import pytest
from mlflow.tracking import MlflowClient

from unirl_ray.config.recipe import load_recipe
from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "ar", "tiny", "char_grpo_direct.yaml")


def kill_rank(trainer, rank):
    """SIGKILL one train worker process (as a crash would); returns its pid."""
    pid = trainer.group.call("ping", {})[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def logged(trainer, key):
    """{step: [values in logging order]} of a metric (a replayed step has two)."""
    client = MlflowClient(trainer.tracker.tracking_uri)
    out = {}
    for m in sorted(client.get_metric_history(trainer.tracker.run_id, key), key=lambda m: m.timestamp):
        out.setdefault(m.step, []).append(m.value)
    return out


def test_killed_worker_mid_step_is_restarted_and_the_run_ends_as_if_nothing_happened(ray_local, tmp_path):
    """GRPO, 2 ranks: checkpoint at step 4, step 5 logged, rank 1 killed while step 6 trains. The run
    rewinds to step 4 and replays steps 5 and 6 with the same prompts and the same numbers (weights,
    optimizer, RNG and data cursor all come from the checkpoint); one MLflow run; the restart counted."""
    steps = 6
    cfg = load_recipe(RECIPE, [
        "trainer.run_name=killed", f"trainer.storage_path={tmp_path}", f"trainer.num_steps={steps}",
        "trainer.checkpoint_every=4", "tracking.experiment_name=faults", "tracking.log_samples_every=0",
        "++ray.max_failures=1", "ray.scaling.num_workers=2"])
    trainer = ARTrainer(cfg)
    killed, first_draw, original = [], {}, trainer.train

    def train(samples, *, seed):
        step, prompts = trainer.prompt_log[-1]
        first_draw.setdefault(step, prompts)
        if step == steps and not killed:  # step 6's samples are out, its training starts
            killed.append(kill_rank(trainer, 1))
        return original(samples, seed=seed)

    trainer.train = train
    trainer.fit()

    assert killed and trainer.restarts == 1 and trainer.policy_version == steps
    assert [s for s, _ in trainer.prompt_log] == list(range(1, steps + 1))
    assert dict(trainer.prompt_log) == first_draw  # the data cursor rewound: steps 5, 6 drew the same prompts
    for key in ("reward/mean", "train/loss", "train/grad_norm"):
        values = logged(trainer, key)
        assert sorted(values) == list(range(1, steps + 1)), key
        assert len(values[5]) == 2 and values[5][0] == pytest.approx(values[5][1], rel=1e-6, abs=1e-9), key
        assert all(len(v) == 1 for s, v in values.items() if s != 5), key
    assert logged(trainer, "fault/worker_group_restarts") == {4: [1.0]}  # rewound to the step-4 checkpoint
    client = MlflowClient(trainer.tracker.tracking_uri)
    exp = client.get_experiment_by_name("faults")
    runs = client.search_runs([exp.experiment_id], "tags.mlflow.runName = 'killed'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"


def test_sft_worker_killed_mid_call_replays_the_lost_steps_on_the_same_records(ray_local, tmp_path):
    """SFT: kill rank 1 while step 5 trains (checkpoint at 3, step 4 already logged). The restarted feeds
    start again at the step-3 data cursor, so steps 4 and 5 train on the same records with the same
    result: step 4's loss logged before the kill equals the one logged after it."""
    from unirl_ray.trainer.sft import SFTTrainer

    cfg = load_recipe(os.path.join(os.path.dirname(RECIPE), "..", "..", "sft", "tiny", "char_chat_sft.yaml"), [
        "trainer.run_name=sft-killed", f"trainer.storage_path={tmp_path}", "tracking.experiment_name=faults",
        "trainer.num_steps=6", "trainer.checkpoint_every=3", "trainer.steps_per_call=1", "trainer.eval_every=0",
        "trainer.batch_size=8", "data.eval_fraction=0.0", "++ray.max_failures=1", "ray.scaling.num_workers=2"])
    trainer = SFTTrainer(cfg)
    killed, original = [], trainer.train_steps

    def train_steps(first, count):
        if first == 5 and not killed:
            killed.append(kill_rank(trainer, 1))
        return original(first, count)

    trainer.train_steps = train_steps
    trainer.fit()
    assert killed and trainer.restarts == 1
    losses = logged(trainer, "train/loss")
    assert sorted(losses) == list(range(1, 7))
    assert len(losses[4]) == 2 and losses[4][0] == pytest.approx(losses[4][1], rel=1e-6)  # replayed exactly
    assert all(len(v) == 1 for s, v in losses.items() if s != 4)
    tokens = logged(trainer, "data/trained_tokens")
    assert tokens[4][0] == tokens[4][1] > 0  # the same records, from the checkpoint's data cursor


def test_async_trainer_restarts_its_rollout_stream_after_a_worker_death(ray_local, tmp_path):
    """Async GRPO: the worker is killed while step 5 trains (checkpoint at 3). The controller drops the
    stream (its batches were for steps that run again), republishes the checkpoint's weights and
    streams again from the checkpoint's data cursor; staleness and no-double-training checks hold."""
    from unirl_ray.trainer.async_rl import AsyncARTrainer

    steps = 5
    cfg = load_recipe(os.path.join(os.path.dirname(RECIPE), "char_grpo_async.yaml"), [
        "trainer.run_name=async-killed", f"trainer.storage_path={tmp_path}", f"trainer.num_steps={steps}",
        "trainer.checkpoint_every=3", "tracking.experiment_name=faults", "tracking.log_samples_every=0",
        "++ray.max_failures=1"])
    trainer = AsyncARTrainer(cfg)
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
