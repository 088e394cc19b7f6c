"""End to end on CPU: Ray Train workers, a Serve reward app, Ray Data prompts, MLflow.

Real parts only: the tiny SD3 is a real diffusers pipeline built from config. Flow-GRPO, after a killed
rank, resumes exactly (LoRA on 2 FSDP2 ranks over gloo); DiffusionNFT (1 worker, EMA shadow adapter) raises
the reward through the trainer. One worker where the rank count does not matter: it starts faster. That
Flow-GRPO learns on the tiny SD3 (metrics, images and recipe in MLflow, synchronous checkpoints) is asserted
on the job that ``tests/ray/test_job_submit.py`` submits to a real head node with the same recipe.
"""

import json

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from support import ONE_WORKER, attempts, drive, history, kill_rank, make, recipe_path

from unirl_ray.trainer.diffusion import DiffusionTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

RECIPE = recipe_path("diffusion", "sd3", "sd3_tiny_flowgrpo.yaml")


# LoRA (peft, injected before the FSDP2 wrap) with a KL term to the adapter-free reference: the
# checkpoint then holds adapter shards and AdamW state only.
LORA = ("backend.lora_cfg={_target_: unirl_ray.train.configs.LoraConfig, rank: 4, alpha: 8}", "algorithm.kl_beta=0.01",
        "backend.optimizer_cfg.learning_rate=3e-2", "trainer.checkpoint_every=2", "tracking.log_samples_every=0")


def test_a_restart_resumes_lora_adapters_optimizer_and_data_exactly(ray_local, tmp_path):
    """Two FSDP2 ranks train LoRA adapters with a KL term; rank 1 is SIGKILLed while step 4 trains: Ray Train
    restarts the worker group, the ranks load the step-2 checkpoint (adapter shards + AdamW state), the
    controller rewinds its prompt cursor, and step 3 runs again with the same prompts and the same numbers.
    (A stopped job re-run from its run folder resumes through the same checkpoint load: PE, AR and SFT test
    that path with a fresh driver.)"""
    trainer = make(DiffusionTrainer, RECIPE, tmp_path, "resumed", "trainer.num_steps=4", "++ray.max_failures=1",
                   *LORA, experiment="e2e")
    pids, trained, original = [], [], trainer.train

    def train(samples, *, seed):
        trained.append(trainer.prompt_log[-1])
        if trainer.prompt_log[-1][0] == 4 and not pids:  # step 4's samples are out, its training starts
            pids.append(kill_rank(trainer, 1))
        return original(samples, seed=seed)

    trainer.train = train
    trainer.fit()
    assert pids and trainer.restarts == 1
    # steps 3 and 4 ran again after the rewind to the step-2 checkpoint: with the same prompts ...
    assert [s for s, _ in trained] == [1, 2, 3, 4, 3, 4] and trained[2:4] == trained[4:]
    assert [s for s, _ in trainer.prompt_log] == [1, 2, 3, 4]
    for key in ("reward/mean", "train/loss", "algo/approx_kl", "train/grad_norm"):  # ... and the same numbers
        values = attempts(trainer, key)
        assert sorted(values) == [1, 2, 3, 4], key  # one MLflow run
        assert len(values[3]) == 2 and values[3][0] == pytest.approx(values[3][1], rel=1e-5, abs=1e-9), key
        assert all(len(v) == 1 for step, v in values.items() if step != 3), key
    assert history(trainer, "train/kl")[-1] > 0
    client = MlflowClient(trainer.tracker.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id], "tags.mlflow.runName = 'resumed'")
    assert len(runs) == 1
    # asynchronous checkpoints (the default): the saves returned before their commit (written and committed
    # in the background: the step-2 one is what the restart loaded), and the run's end waited for the last
    timing, waits = attempts(trainer, "checkpoint/write_s"), attempts(trainer, "checkpoint/commit_wait_s")
    assert sorted(timing) == [2, 4] and all(v < 1e-3 for vs in waits.values() for v in vs), waits
    with open(tmp_path / "resumed" / "checkpoint_000004" / "controller_state.json") as f:
        state = json.load(f)
    assert state["step"] == 4 and state["controller"]["data"] == trainer.data.state_dict()


NFT_RECIPE = recipe_path("diffusion", "sd3", "sd3_tiny_nft.yaml")


def nft_steps(tmp_path, run_name, steps, *overrides):
    """The tiny DiffusionNFT recipe on 1 Ray Train worker, ``steps`` steps through ``run_step``; the metrics."""
    trainer = make(DiffusionTrainer, NFT_RECIPE, tmp_path, run_name, f"trainer.num_steps={steps}",
                   "trainer.checkpoint_every=100", "tracking.log_samples_every=0", *ONE_WORKER,
                   *overrides, experiment="e2e")
    return drive(trainer, steps)


def test_nft_raises_reward_through_the_trainer(ray_local, tmp_path):
    """DiffusionNFT through the trainer (ODE rollout with the EMA shadow adapter, the shadow moved once per
    step): brightness rises by several times the untrained model's within-step spread; the same run with
    the reward negated makes the images darker, so the signal, not a drift, moves them."""
    steps = 12  # seen: +0.0086 and -0.012 vs a spread of 0.0017; with 10 steps the negated run had barely moved
    up = nft_steps(tmp_path, "nft-up", steps)
    down = nft_steps(tmp_path, "nft-down", steps, "reward.rewards.brightness.weight=-1.0")

    def gain(history):
        brightness = [m["reward/brightness/mean"] for m in history]  # the raw score, before the weight
        return np.mean(brightness[-3:]) - np.mean(brightness[:3])

    spread = np.mean([m["reward/brightness/std"] for m in up[:3]])
    print(f"NFT brightness gain over {steps} steps: {gain(up):+.4f} (negated reward: {gain(down):+.4f}); "
          f"untrained within-step spread {spread:.4f}")
    assert up[0]["reward/brightness/mean"] == pytest.approx(down[0]["reward/brightness/mean"])  # same start
    assert gain(up) > 3 * spread, (gain(up), spread, [m["reward/mean"] for m in up])
    assert gain(down) < -spread, (gain(down), spread, [m["reward/brightness/mean"] for m in down])
    assert all(m["reward/mean"] == pytest.approx(-m["reward/brightness/mean"]) for m in down)

    for key in ("train/loss", "algo/pos_loss", "algo/neg_loss", "algo/optimality", "algo/adv_std"):
        assert all(np.isfinite(m[key]) for m in up), key
    assert "algo/clip_frac" not in up[-1]  # NFT has no ratio to clip: these are not Flow-GRPO's metrics
    # the shadow (old policy) follows the ramp decay min(0.001 (i - 1), 0.5) and lags the trained adapter
    assert [m["train/ema_lora_decay"] for m in up] == pytest.approx([0.001 * i for i in range(steps)])
    deviation = [m["algo/old_deviation"] for m in up]
    assert deviation[0] == 0.0 and max(deviation) > 0, deviation
