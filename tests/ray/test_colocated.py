"""The colocated dedicated engine on CPU: train workers and the HF engine take turns on the same
devices (offload -> engine wakes, loads the latest version, generates, sleeps -> onload).

On a CPU machine host and device are the same memory, so "freed" means what the mechanism does on
a GPU: every device storage of the train state (parameters, gradients, AdamW moments) and of the
engine's weights is released (resized to 0) while the other side runs; the bytes are checked. The
run must match the separate layout's numbers exactly (same seeds, same weights, same samples).
"""

import os

import pytest

from unirl_ray.config.recipe import load_recipe
from unirl_ray.trainer.ar import ARTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "ar", "tiny", "char_grpo_engine.yaml")
STEPS = 4


def run(tmp_path, name, *overrides):
    cfg = load_recipe(RECIPE, [f"trainer.run_name={name}", f"trainer.storage_path={tmp_path}",
                               "tracking.experiment_name=e2e-colocated", f"trainer.num_steps={STEPS}",
                               "trainer.checkpoint_every=100", *overrides])
    trainer = ARTrainer(cfg)
    history, status = [], "FAILED"
    try:
        trainer.setup()
        # train workers run at the driver's priority (ray.worker_niceness=0; raising it needs root)
        assert all(r["niceness"] == (0 if os.geteuid() == 0 else 15) for r in trainer.group.call("ping", {}))
        if trainer.engine.colocated:
            assert all(r["asleep"] for r in trainer.engine.status())  # asleep while the workers start
        for step in range(1, STEPS + 1):
            metrics = trainer.run_step(step)
            history.append(metrics)
            if trainer.engine.colocated:  # asleep again during training, holding nothing
                reports = trainer.engine.status()
                assert all(r["asleep"] and r["version"] == step - 1 for r in reports), reports
        status = "FINISHED"
    finally:
        trainer.teardown(status)
    return history


def test_colocated_engine_takes_turns_and_matches_the_separate_layout(ray_local, tmp_path):
    colocated = run(tmp_path, "colocated", "rollout.placement=colocated")
    for m in colocated:
        assert m["colocate/train_bytes_offloaded"] > 0
        assert m["colocate/train_bytes_resident"] == 0  # nothing of the train state stays on the device
        assert m["colocate/engine_bytes_freed"] > 0
        assert m["rollout/logp_gap"] < 1e-4  # the woken engine serves exactly the trainer's weights
        assert m["rollout/version_lag_max"] == 0
    separate = run(tmp_path, "separate")
    for a, b in zip(colocated, separate):
        for key in ("reward/mean", "train/loss", "train/grad_norm", "rollout/response_len_mean"):
            assert a[key] == b[key], (key, a[key], b[key])
