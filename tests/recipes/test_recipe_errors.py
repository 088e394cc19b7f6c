"""Bad recipes fail on the driver, before any worker (or Ray) starts, with a message that says what to fix."""

import json
import os

import pytest

from unirl_ray.cli import run_trainer
from unirl_ray.config.recipe import RecipeError, load_recipe
from unirl_ray.trainer.diffusion import DiffusionTrainer

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TINY = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_tiny_flowgrpo.yaml")
REAL = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_5_medium_flowgrpo.yaml")


def build(path=TINY, *overrides):
    return DiffusionTrainer(load_recipe(path, list(overrides)))


def test_tiny_recipe_validates_without_ray():
    import ray

    trainer = build(TINY)
    assert trainer.group_size == 4 and trainer.is_demo()
    assert not ray.is_initialized()


def test_unknown_key_names_closest():
    with pytest.raises(RecipeError, match="learning_rate"):
        build(TINY, "backend.optimizer_cfg.learning_rat=0.1")


def test_target_that_does_not_import():
    with pytest.raises(RecipeError, match="FlowGRPO"):
        build(TINY, "algorithm._target_=unirl_ray.algorithms.FlowGRPOO")


def test_unknown_constructor_argument():
    with pytest.raises(RecipeError, match="clip_range"):
        build(TINY, "+algorithm.clip_rnge=0.1")


def test_missing_env_var_is_named(monkeypatch):
    monkeypatch.delenv("PRETRAINED_MODEL", raising=False)
    with pytest.raises(RecipeError, match="PRETRAINED_MODEL"):
        build(REAL)


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(RecipeError, match="does-not-exist"):
        build(TINY, f"bundle.config.pretrained_model_ckpt_path={tmp_path}/does-not-exist")


def test_real_recipe_validates_against_model_folder_configs(monkeypatch, tmp_path):
    """A folder with only the JSON configs is enough for driver-side validation (no weights read)."""
    (tmp_path / "vae").mkdir()
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [128, 256, 512, 512]}))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"patch_size": 2}))
    monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path))
    trainer = build(REAL)
    assert not trainer.is_demo()
    with pytest.raises(RecipeError, match="multiple of 16"):
        build(REAL, "pipeline.height=520")


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.group_size=1", "group_size"),
        ("backend.optimizer_cfg.learning_rate=-0.1", "learning_rate"),
        ("pipeline.height=30", "multiple of 4"),
        ("ray.scaling.num_workers=3", "divide evenly"),
        ("trainer.prompts_per_step=3", "must split into mini-batches"),
        ("stack.mini_batch_size=3", "multiple of micro_batch_size"),
        ("stack.num_updates_per_batch=0", "num_updates_per_batch"),
        ("trainer.num_steps=0", "num_steps"),
        ("data.path=/nonexistent/prompts.txt", "/nonexistent/prompts.txt"),
        ("reward.rewards.brightness.fn=unirl_ray.rewards.image.brightnes", "brightness"),
        ("ray.scaling.num_workers=0", "num_workers"),
        # YAML reads "{kind:constant}" (no space after the colons) as keys without values, not as pairs
        ("backend.lr_scheduler_cfg={kind:constant,warmup_steps:10}", "backend.lr_scheduler_cfg must be a LrSchedulerConfig"),
    ],
)
def test_invalid_values(override, message):
    with pytest.raises((RecipeError, ValueError), match=message):
        build(TINY, override)


def test_cli_prints_one_clear_line_and_exits_2(capsys):
    code = run_trainer(DiffusionTrainer, [TINY, "trainer.num_step=3"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("recipe error:") and "num_steps" in err


def test_cli_rejects_non_override_arguments(capsys):
    assert run_trainer(DiffusionTrainer, [TINY, "--steps", "3"]) == 2
    assert "key=value" in capsys.readouterr().err


def test_real_ar_recipe_validates_against_a_model_folder(monkeypatch, tmp_path):
    from unirl_ray.trainer.ar import ARTrainer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path))
    monkeypatch.delenv("GSM8K_JSONL", raising=False)
    path = os.path.join(ROOT, "recipes", "ar", "qwen2_5", "gsm8k_grpo_engine.yaml")
    trainer = ARTrainer(load_recipe(path))
    assert trainer.dedicated is not None and trainer.sync.every == 1
    assert trainer.data.prompt_column == "question"
    monkeypatch.delenv("PRETRAINED_MODEL")
    with pytest.raises(RecipeError, match="PRETRAINED_MODEL"):
        ARTrainer(load_recipe(path))


@pytest.mark.parametrize("name", ["char_grpo_direct.yaml", "char_grpo_engine.yaml"])
def test_tiny_ar_recipes_validate(name):
    from unirl_ray.trainer.ar import ARTrainer

    trainer = ARTrainer(load_recipe(os.path.join(ROOT, "recipes", "ar", "tiny", name)))
    assert trainer.is_demo() and (trainer.dedicated is not None) == ("engine" in name)


def test_ar_recipe_rejects_unknown_engine():
    from unirl_ray.trainer.ar import ARTrainer

    path = os.path.join(ROOT, "recipes", "ar", "tiny", "char_grpo_engine.yaml")
    with pytest.raises(RecipeError, match="rollout.engine"):
        ARTrainer(load_recipe(path, ["rollout.engine=sglang"]))


def test_backend_adapter_configs_checked_on_the_driver():
    nft = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_tiny_nft.yaml")
    with pytest.raises(RecipeError, match="set backend.ema_lora_cfg"):
        build(nft, "backend.ema_lora_cfg=null")
    lora = "{_target_: unirl_ray.train.configs.LoraConfig, rank: 4}"
    with pytest.raises(RecipeError, match="keep only ema_lora_cfg"):
        build(nft, f"backend.lora_cfg={lora}")
    with pytest.raises(RecipeError, match="hsdp_shard_size=3 does not divide"):
        build(TINY, "backend.fsdp_cfg.fsdp_mode=hybrid", "+backend.fsdp_cfg.hsdp_shard_size=3")


def test_video_frame_count_checked_on_the_driver():
    wan = os.path.join(ROOT, "recipes", "diffusion", "wan", "wan_tiny_flowgrpo.yaml")
    build(wan)  # the shipped tiny video recipe is valid
    with pytest.raises(RecipeError, match="pipeline: .*num_frames|pipeline: .*frames"):
        build(wan, "pipeline.num_frames=4")
