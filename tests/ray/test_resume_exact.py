"""Exact resume and restart of the AR trainer through Ray Train checkpoints (``ray.train.report`` + DCP
shards) on CPU, 2 FSDP2 ranks over gloo.

One straight run serves every test here: GRPO to step 6 with a checkpoint every 2 steps, in which rank 1
is SIGKILLed while step 6 trains. Ray Train restarts the worker group (``ray.max_failures``), the
restarted workers load the step-4 checkpoint, the controller rewinds to it and runs steps 5 and 6 again:
the same steps, prompts and numbers, one MLflow run, the restart counted. Its step-2 and step-4
checkpoints were written before the kill, so they are those of an uninterrupted run.

Its storage folder is copied while step 3 trains (``support.copy_run``: the step-2 checkpoint committed,
nothing newer): a fit of the copy resumes after step 2, as a job stopped there would. Resuming to step 4
must give bit-identical parameters and optimizer state to that run: every random choice is derived from
(seed, step, index), the DCP checkpoint holds model, optimizer, scheduler, EMA and per-rank RNG state, and
the controller state holds the data cursor. Resuming the same step-2 checkpoint on ONE worker instead of two (DCP reshards the FSDP2
shards) continues the same run: the mini-batch is counted over all ranks, so the math is the same, but
gloo's two-rank gradient reduction adds in a different order than one rank does, so the parameters
agree to float rounding, not bit for bit.
"""

import json
import os

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from support import attempts, copy_run, fit, kill_rank, load, make, recipe_path

from unirl_ray.train.rank import StackWorker
from unirl_ray.runtime.worker import SHARDS_DIR, STATE_FILE
from unirl_ray.train.configs import TrainTopology
from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = recipe_path("ar", "tiny", "char_grpo_direct.yaml")
SECTIONS = ("bundle", "pipeline", "backend", "algorithm", "stack")
COMMON = ("trainer.checkpoint_every=2", "tracking.log_samples_every=0", "ray.scaling.num_workers=2")
STEPS = 6


def trained_state(storage, name, step):
    """Parameters and AdamW state of the run's checkpoint at ``step``, loaded in this process."""
    cfg = load(RECIPE, storage, name, f"trainer.num_steps={step}")
    directory = os.path.join(storage, name, f"checkpoint_{step:06d}")
    with open(os.path.join(directory, STATE_FILE)) as f:
        state = json.load(f)
    assert state["step"] == step
    sections = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in SECTIONS}
    worker = StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))
    worker.load(os.path.join(directory, SHARDS_DIR), state["backend"])
    backend = worker.backend
    params = {k: v.detach().clone() for k, v in backend.module.state_dict().items()}
    moments = [t.clone() for s in backend.optimizer.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
    return params, moments, state


@pytest.fixture(scope="module")
def killed(ray_local, tmp_path_factory):
    """The straight run (see the module docstring): (trainer, storage, pids killed, first prompts per step,
    two copies of its storage made while step 3 trained)."""
    storage, copies = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("copies")
    at_step_2 = (copies / "two_workers", copies / "one_worker")
    trainer = make(ARTrainer, RECIPE, storage, "killed", f"trainer.num_steps={STEPS}", *COMMON, "++ray.max_failures=1",
                   "++ray.num_checkpoints_to_keep=null", experiment="faults")
    pids, first_draw, original = [], {}, trainer.train

    def train(samples, *, seed):
        step, prompts = trainer.prompt_log[-1]
        first_draw.setdefault(step, prompts)
        if step == 3 and not at_step_2[0].exists():
            for copy in at_step_2:
                copy_run(trainer, copy)
        if step == STEPS and not pids:  # step 6's samples are out, its training starts
            pids.append(kill_rank(trainer, 1))
        return original(samples, seed=seed)

    trainer.train = train
    trainer.fit()
    return trainer, storage, pids, first_draw, at_step_2


def test_killed_worker_mid_step_is_restarted_and_the_run_ends_as_if_nothing_happened(killed):
    trainer, _, pids, first_draw, _ = killed
    assert pids and trainer.restarts == 1 and trainer.policy_version == STEPS
    assert [s for s, _ in trainer.prompt_log] == list(range(1, STEPS + 1))
    assert dict(trainer.prompt_log) == first_draw  # the data cursor rewound: steps 5, 6 drew the same prompts
    for key in ("reward/mean", "train/loss", "train/grad_norm"):
        values = attempts(trainer, key)
        assert sorted(values) == list(range(1, STEPS + 1)), key
        assert len(values[5]) == 2 and values[5][0] == pytest.approx(values[5][1], rel=1e-6, abs=1e-9), key
        assert all(len(v) == 1 for s, v in values.items() if s != 5), key
    assert attempts(trainer, "fault/worker_group_restarts") == {4: [1.0]}  # rewound to the step-4 checkpoint
    client = MlflowClient(trainer.tracker.tracking_uri)
    exp = client.get_experiment_by_name("faults")
    runs = client.search_runs([exp.experiment_id], "tags.mlflow.runName = 'killed'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"


def test_resume_is_exact_and_reshards_onto_fewer_workers(killed):
    _, straight_dir, _, _, (split_dir, reshard_dir) = killed  # the same step-2 checkpoint; the second on 1 worker
    resumed = fit(ARTrainer, RECIPE, split_dir, "killed", "trainer.num_steps=4", *COMMON, experiment="e2e-resume")
    assert resumed.prompt_log[0][0] == 3  # resumed after the saved step, in the same MLflow run
    fit(ARTrainer, RECIPE, reshard_dir, "killed", "trainer.num_steps=4", *COMMON, "ray.scaling.num_workers=1",
        "ray.scaling.resources_per_worker.CPU=2", experiment="e2e-resume")

    want_params, want_moments, want_state = trained_state(straight_dir, "killed", 4)
    got_params, got_moments, got_state = trained_state(split_dir, "killed", 4)
    assert want_state["controller"]["data"] == got_state["controller"]["data"]  # same prompts consumed
    changed = trained_state(straight_dir, "killed", 2)[0]
    assert any(not torch.equal(want_params[k], changed[k]) for k in want_params)  # steps 3-4 did train
    for k in want_params:
        assert torch.equal(want_params[k], got_params[k]), k
    for a, b in zip(want_moments, got_moments, strict=True):
        assert torch.equal(a, b)

    reshard_params, _, reshard_state = trained_state(reshard_dir, "killed", 4)
    assert reshard_state["backend"]["world_size"] == 1
    for k in want_params:
        torch.testing.assert_close(reshard_params[k], want_params[k], rtol=1e-4, atol=1e-5, msg=k)
