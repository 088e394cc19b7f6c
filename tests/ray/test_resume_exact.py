"""Exact resume through Ray Train checkpoints (``ray.train.report`` + DCP shards) on CPU.

Training straight to step 4 and training to step 2, stopping, and resuming to step 4 must give
bit-identical parameters and optimizer state: every random choice is derived from (seed, step,
index), the DCP checkpoint holds model, optimizer, scheduler, EMA and per-rank RNG state, and the
controller state holds the data cursor. Resuming the same step-2 checkpoint on ONE worker instead
of two (DCP reshards the FSDP2 shards) continues the same run: the mini-batch is counted over all
ranks, so the math is the same, but gloo's two-rank gradient reduction adds in a different order
than one rank does, so the parameters agree to float rounding, not bit for bit.
"""

import json
import os
import shutil

import pytest
import torch
from omegaconf import OmegaConf

from unirl_ray.config.recipe import load_recipe
from unirl_ray.runtime.stack_worker import StackWorker
from unirl_ray.runtime.worker import SHARDS_DIR, STATE_FILE
from unirl_ray.train.configs import TrainTopology
from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "ar", "tiny", "char_grpo_direct.yaml")
SECTIONS = ("bundle", "pipeline", "backend", "algorithm", "stack")


def recipe(storage, name, steps, *overrides):
    return load_recipe(RECIPE, [f"trainer.run_name={name}", f"trainer.storage_path={storage}", f"trainer.num_steps={steps}",
                                "trainer.checkpoint_every=2", "tracking.experiment_name=e2e-resume",
                                "tracking.log_samples_every=0", *overrides])


def fit(storage, name, steps, *overrides):
    trainer = ARTrainer(recipe(storage, name, steps, *overrides))
    trainer.fit()
    return trainer


def trained_state(storage, name, step):
    """Parameters and AdamW state of the run's checkpoint at ``step``, loaded in this process."""
    cfg = recipe(storage, name, step)
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


def test_resume_is_exact_and_reshards_onto_fewer_workers(ray_local, tmp_path):
    straight_dir, split_dir, reshard_dir = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    fit(straight_dir, "run", 4)
    fit(split_dir, "run", 2)
    shutil.copytree(split_dir, reshard_dir)  # the same step-2 checkpoint, resumed elsewhere on 1 worker
    resumed = fit(split_dir, "run", 4)
    assert resumed.prompt_log[0][0] == 3  # resumed after the saved step, in the same MLflow run
    fit(reshard_dir, "run", 4, "ray.scaling.num_workers=1", "ray.scaling.resources_per_worker.CPU=2")

    want_params, want_moments, want_state = trained_state(straight_dir, "run", 4)
    got_params, got_moments, got_state = trained_state(split_dir, "run", 4)
    assert want_state["controller"]["data"] == got_state["controller"]["data"]  # same prompts consumed
    changed = trained_state(straight_dir, "run", 2)[0]
    assert any(not torch.equal(want_params[k], changed[k]) for k in want_params)  # steps 3-4 did train
    for k in want_params:
        assert torch.equal(want_params[k], got_params[k]), k
    for a, b in zip(want_moments, got_moments, strict=True):
        assert torch.equal(a, b)

    reshard_params, _, reshard_state = trained_state(reshard_dir, "run", 4)
    assert reshard_state["backend"]["world_size"] == 1
    for k in want_params:
        torch.testing.assert_close(reshard_params[k], want_params[k], rtol=1e-4, atol=1e-5, msg=k)
