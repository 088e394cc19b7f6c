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
STEPS, KILL_AT = 6, 5


def make(tmp_path, name):
    cfg = load_recipe(RECIPE, [
        f"trainer.run_name={name}", f"trainer.storage_path={tmp_path}", f"trainer.num_steps={STEPS}",
        "trainer.checkpoint_every=2", "tracking.experiment_name=faults", "tracking.log_samples_every=0",
        "++ray.max_failures=1", "ray.scaling.num_workers=2"])
    return ARTrainer(cfg)


def history(trainer, key):
    client = MlflowClient(trainer.tracker.tracking_uri)
    return {m.step: m.value for m in client.get_metric_history(trainer.tracker.run_id, key)}


def test_killed_worker_mid_step_is_restarted_and_the_run_ends_as_if_nothing_happened(ray_local, tmp_path):
    straight = make(tmp_path, "straight")
    straight.fit()

    faulty = make(tmp_path, "killed")
    killed = []
    original = faulty.train

    def train(samples, *, seed):
        if len(faulty.prompt_log) == KILL_AT and not killed:  # step 5's samples are out, training starts
            pid = faulty.group.call("ping", {})[1]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return original(samples, seed=seed)

    faulty.train = train
    faulty.fit()

    assert killed and faulty.restarts == 1
    assert faulty.policy_version == straight.policy_version == STEPS
    # the data position: the same prompts step for step (step 5's first draw was rewound to the checkpoint)
    assert [p for _, p in faulty.prompt_log] == [p for _, p in straight.prompt_log]
    for key in ("reward/mean", "train/loss", "train/grad_norm"):
        got, want = history(faulty, key), history(straight, key)
        assert sorted(got) == list(range(1, STEPS + 1)), key
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), key  # restored weights, optimizer, RNG, data
    assert history(faulty, "fault/worker_group_restarts") == {4: 1.0}  # rewound to the step-4 checkpoint
    client = MlflowClient(faulty.tracker.tracking_uri)
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
            pid = trainer.group.call("ping", {})[1]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return original(first, count)

    trainer.train_steps = train_steps
    trainer.fit()
    assert killed and trainer.restarts == 1
    client = MlflowClient(trainer.tracker.tracking_uri)
    losses = {}
    for m in client.get_metric_history(trainer.tracker.run_id, "train/loss"):
        losses.setdefault(m.step, []).append(m.value)
    assert sorted(losses) == list(range(1, 7))
    assert len(losses[4]) == 2 and losses[4][0] == pytest.approx(losses[4][1], rel=1e-6)  # replayed exactly
    assert all(len(v) == 1 for s, v in losses.items() if s != 4)
    tokens = {}
    for m in client.get_metric_history(trainer.tracker.run_id, "data/trained_tokens"):
        tokens.setdefault(m.step, []).append(m.value)
    assert tokens[4][0] == tokens[4][1] > 0  # the same records, from the checkpoint's data cursor
