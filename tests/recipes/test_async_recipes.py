"""Async recipes validate on the driver (tiny and real ones), and async-specific mistakes are refused
before anything starts."""

import json
import os

import pytest

from unirl_ray.config.recipe import RecipeError, load_recipe
from unirl_ray.trainer.async_rl import AsyncARTrainer, AsyncDiffusionTrainer

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")
AR = os.path.join(ROOT, "ar", "tiny", "char_grpo_async.yaml")
SD3 = os.path.join(ROOT, "diffusion", "sd3", "sd3_tiny_flowgrpo_async.yaml")


@pytest.mark.parametrize("cls, path", [(AsyncARTrainer, AR), (AsyncDiffusionTrainer, SD3)])
def test_tiny_async_recipes_validate(cls, path):
    trainer = cls(load_recipe(path))
    assert trainer.async_cfg.max_staleness == 1 and trainer.dedicated.placement == "separate"
    assert trainer.algorithm.off_policy.decoupled and trainer.is_demo()


def test_real_async_recipes_validate_against_model_folders(monkeypatch, tmp_path):
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    monkeypatch.setenv("PRETRAINED_MODEL", str(lm))
    ar = AsyncARTrainer(load_recipe(os.path.join(ROOT, "ar", "qwen2_5", "gsm8k_grpo_async.yaml")))
    assert ar.dedicated.num_replicas == 2 and ar.algorithm.off_policy.is_cap == 2.0

    sd = tmp_path / "sd3"
    for sub in ("vae", "transformer"):
        (sd / sub).mkdir(parents=True)
    (sd / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    (sd / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [128, 256, 512, 512]}))
    (sd / "transformer" / "config.json").write_text(json.dumps({"patch_size": 2}))
    monkeypatch.setenv("PRETRAINED_MODEL", str(sd))
    diffusion = AsyncDiffusionTrainer(load_recipe(os.path.join(ROOT, "diffusion", "sd3", "sd3_5_medium_flowgrpo_async.yaml")))
    assert diffusion.dedicated.resources() == {"CPU": 8.0, "GPU": 4.0}


def test_async_needs_a_separate_engine():
    trainside = "rollout={_target_: unirl_ray.rollout.TrainsideRollout, micro_batch_size: 8}"
    with pytest.raises(RecipeError, match="placement: separate"):
        AsyncARTrainer(load_recipe(AR, [trainside]))
    with pytest.raises(RecipeError, match="placement: separate"):
        AsyncARTrainer(load_recipe(AR, ["rollout.placement=colocated"]))


def test_staleness_must_cover_the_publish_interval():
    with pytest.raises(RecipeError, match=r"max_staleness=1 is below sync.every - 1 = 2"):
        AsyncARTrainer(load_recipe(AR, ["sync.every=3"]))
    assert AsyncARTrainer(load_recipe(AR, ["sync.every=3", "async_rollout.max_staleness=2"])).sync.every == 3


@pytest.mark.parametrize("override, message", [
    ("async_rollout.max_staleness=-1", "max_staleness"),
    ("async_rollout.partial_rollout=abort", "partial_rollout"),
    ("async_rollout.wait_timeout_s=0", "wait_timeout_s"),
    ("algorithm.off_policy.mode=vtrace", "off_policy.mode"),
])
def test_bad_async_options_are_refused(override, message):
    with pytest.raises((RecipeError, ValueError), match=message):
        AsyncARTrainer(load_recipe(AR, [override]))
