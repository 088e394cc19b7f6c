"""Diffusion layouts end to end on CPU (one Ray Train worker, tiny SD3 built from config; the rank count does
not matter to what is checked here, and two-rank SD3 training is in test_e2e_diffusion.py's resume test):

- the separate layout: a dedicated HF engine app (2 replicas) samples; after every step the LoRA
  adapters (only) reach every replica, verified by version and checksum; engine log-probs equal the
  trainer's at step start;
- reward placement: a CLIP image-model reward runs as its own Serve app next to the shared rule app (in
  Serve here, ``reward.placement=serve``: the other runs score their rule rewards in the driver);
- evaluation with the mirror EMA: held-out prompts every ``eval_every`` steps, deterministic, and the
  training weights unchanged by it (checksum through a worker op).
"""


import numpy as np
import pytest
import support
from support import artifacts, drive, logged

from unirl_ray.trainer.diffusion import DiffusionTrainer

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


def make(tmp_path, recipe, name, *overrides):
    return support.make(DiffusionTrainer, support.recipe_path("diffusion", "sd3", recipe), tmp_path, name,
                        "trainer.checkpoint_every=100", "tracking.log_samples_every=0", "ray.scaling.num_workers=1",
                        "ray.scaling.resources_per_worker.CPU=2",
                        *overrides,
                        experiment="e2e-layouts")


def lora_bytes(trainer):
    """Bytes of the LoRA adapters of the recipe's transformer (what a LoRA-only sync must move)."""
    from unirl_ray.config.recipe import instantiate
    from unirl_ray.train.backend.lora import inject_lora

    bundle = instantiate(trainer.recipe.bundle)
    inject_lora(bundle.transformer, instantiate(trainer.recipe.backend.lora_cfg))
    adapters = [p for n, p in bundle.transformer.named_parameters() if "lora_" in n]
    full = sum(p.numel() * p.element_size() for p in bundle.transformer.parameters())
    return sum(p.numel() * p.element_size() for p in adapters), full


def test_separate_layout_syncs_lora_to_every_replica_on_policy(ray_local, tmp_path):
    steps = 3
    trainer = make(tmp_path, "sd3_tiny_flowgrpo_engine.yaml", "separate", f"trainer.num_steps={steps}",
                   "rollout.num_replicas=2", "rollout.ray_actor_options={num_cpus: 0.25}")
    expected_bytes, full_bytes = lora_bytes(trainer)
    checksums = []

    def check(step, metrics):
        reports = trainer.engine.status()
        assert len(reports) == 2, reports
        assert all(r["version"] == step and r["checksum"] == trainer.engine.checksum for r in reports), reports
        checksums.append(trainer.engine.checksum)
        if step:
            assert metrics["weight_sync/version"] == step
            assert metrics["weight_sync/bytes"] == expected_bytes < full_bytes  # adapters only
            assert metrics["rollout/version_lag_max"] == 0
            assert metrics["rollout/logp_gap"] < 1e-4, metrics["rollout/logp_gap"]  # engine == trainer
            assert 0.0 < metrics["reward/brightness/mean"] < 1.0  # the engine returned decoded images

    history = drive(trainer, steps, check)
    assert len(set(checksums)) == steps + 1  # every step moved the adapters and a new version reached the engine
    assert sorted(logged(trainer, "reward/mean")) == list(range(1, steps + 1))
    for key in ("train/loss", "timing/weight_sync", "algo/clip_frac"):
        assert all(np.isfinite(m[key]) for m in history), key


CLIP = ("+reward.rewards.clip={fn: unirl_ray.rewards.image_model.CLIPScoreReward, weight: 0.5, "
        "kwargs: {tiny: true, device: cpu}, app: {num_replicas: 1, ray_actor_options: {num_cpus: 0.25}}}")
EMA_EVAL = ("+backend.ema_full_cfg={_target_: unirl_ray.train.configs.EmaFullConfig, target_decay: 0.9}",
            "+trainer.eval_every=2", "+trainer.eval_num_prompts=4")
PLACED_STEPS = 4


@pytest.fixture(scope="module")
def placed_run(ray_local, tmp_path_factory):
    """One trainside run for the reward-placement and the eval tests: a CLIP reward app of its own next to
    the shared rule app, a mirror EMA evaluated on held-out prompts every 2 steps; checked after every step.
    Yields (trainer, metrics per step, extra evaluations made after the last step)."""
    from ray import serve

    tmp_path = tmp_path_factory.mktemp("placed")
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("a red fox\na snowy owl\na green frog\na striped tiger\n")
    trainer = make(tmp_path, "sd3_tiny_flowgrpo.yaml", "placed", f"trainer.num_steps={PLACED_STEPS}", CLIP, *EMA_EVAL,
                   f"+trainer.eval_prompts={held_out}", "++reward.placement=serve")
    history, extra, status = [], {}, "FAILED"
    try:
        assert trainer.setup() == 0
        for step in range(1, PLACED_STEPS + 1):
            metrics = trainer.run_step(step)
            trainer.tracker.log_metrics(metrics, step=step)
            history.append(metrics)
            apps = serve.status().applications
            for name in ("placed-reward", "placed-reward-clip"):
                assert name in apps and apps[name].status == "RUNNING", (name, sorted(apps))
            assert [app.name for app in trainer.reward.apps] == ["placed-reward", "placed-reward-clip"]
            assert ("eval/reward_mean" in metrics) == (step % 2 == 0), (step, sorted(metrics))
        checksum = lambda: trainer.group.call("export_weights", {})[0]["checksum"]  # noqa: E731
        before = checksum()
        extra["ema"], extra["again"] = trainer.evaluate(PLACED_STEPS), trainer.evaluate(PLACED_STEPS)
        extra["weights_unchanged"] = checksum() == before
        trainer.run_cfg.eval_with_ema = False
        extra["live"] = trainer.evaluate(PLACED_STEPS)
        status = "FINISHED"
    finally:
        trainer.teardown(status)
    yield trainer, history, extra


def test_image_model_reward_runs_as_its_own_app(placed_run):
    trainer, history, _ = placed_run
    for m in history:  # weighted combination of the two apps' scores (no invalid samples)
        assert m["reward/mean"] == pytest.approx(m["reward/brightness/mean"] + 0.5 * m["reward/clip/mean"], abs=1e-6)
        assert -1.0 <= m["reward/clip/mean"] <= 1.0 and m["reward/clip/std"] > 0
    for key in ("reward/brightness/mean", "reward/clip/mean", "timing/reward/clip"):
        assert sorted(logged(trainer, key)) == list(range(1, PLACED_STEPS + 1)), key


def test_eval_with_ema_is_periodic_deterministic_and_leaves_training_weights(placed_run):
    trainer, _, extra = placed_run
    assert extra["weights_unchanged"]  # the EMA swap restored the training weights bit for bit
    assert extra["ema"]["eval/ema"] == 1.0 and extra["live"]["eval/ema"] == 0.0
    assert extra["ema"]["eval/reward_mean"] == extra["again"]["eval/reward_mean"]  # fixed eval seeds
    assert extra["ema"]["eval/reward_mean"] != extra["live"]["eval/reward_mean"]  # EMA weights differ from live ones
    evals = logged(trainer, "eval/reward_mean")
    assert sorted(evals) == [2, 4] and evals[4] == extra["ema"]["eval/reward_mean"]
    assert sorted(logged(trainer, "eval/reward/brightness/mean")) == [2, 4]
    assert any(a.endswith("step_000002.json") for a in artifacts(trainer, "eval"))
