"""Every recipe shipped under ``recipes/`` builds its trainer on the driver, as ``python recipes/<domain>.py
RECIPE.yaml`` does before anything starts: every ``_target_`` imports and takes its arguments, every section is
one the trainer uses, and the trainer's own checks pass. The real-model recipes are built against folders
that hold only the published configs (``tools.random_checkpoint --configs-only`` for the diffusers families,
a ``config.json`` for the language models), so a recipe that no GPU has run yet is still checked here; a new
recipe is picked up by the glob, and one whose trainer this test does not know fails it."""

import json
import os
from pathlib import Path

import pytest

from unirl_ray.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2] / "recipes"
RECIPES = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.yaml"))
DIFFUSERS = {"sd3": "sd3.5-medium", "wan": "wan2.1-t2v-1.3b", "flux": "flux.1-dev", "qwen_image": "qwen-image"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Configs-only model folders, by kind."""
    from unirl_ray.tools.random_checkpoint import write_checkpoint

    root = tmp_path_factory.mktemp("model-configs")
    out = {}
    for family in sorted(set(DIFFUSERS.values())):
        write_checkpoint(family, str(root / family), configs_only=True)
        out[family] = root / family
    for kind, files in {"qwen2": {"config.json": {"model_type": "qwen2", "max_position_embeddings": 32768}},
                        "qwen2_5_vl": {"config.json": {"model_type": "qwen2_5_vl", "max_position_embeddings": 128000},
                                       "preprocessor_config.json": {}},
                        "janus": {"config.json": {"model_type": "janus"}}}.items():
        (root / kind).mkdir()
        for name, content in files.items():
            (root / kind / name).write_text(json.dumps(content))
        out[kind] = root / kind
    (root / "reward_model").mkdir()  # reward models load on their Serve replicas, not on the driver
    out["reward_model"] = root / "reward_model"
    (root / "records.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                 {"role": "assistant", "content": "hello"}]}) + "\n")
    out["records"] = root / "records.jsonl"
    return out


def model_folder(recipe: str, folders) -> Path:
    """The folder ``$PRETRAINED_MODEL`` names for a recipe (``<domain>/<family>/<name>.yaml``): its family's configs."""
    domain, family, name = recipe.split("/")
    if domain == "diffusion":
        return folders[DIFFUSERS[family]]
    if domain == "pe":  # the prompt enhancer's image model (the LLM is $PRETRAINED_LLM)
        return folders["sd3.5-medium"]
    if domain == "unified":
        return folders["janus"]
    return folders["qwen2_5_vl" if name.startswith("vl_") else "qwen2"]


def trainer_class(cfg):
    from unirl_ray.trainer.agentic import AgenticTrainer
    from unirl_ray.trainer.ar import ARTrainer
    from unirl_ray.trainer.async_rl import AsyncARTrainer, AsyncDiffusionTrainer
    from unirl_ray.trainer.diffusion import DiffusionTrainer
    from unirl_ray.trainer.pe import PETrainer
    from unirl_ray.trainer.sft import SFTTrainer
    from unirl_ray.trainer.unified import UnifiedModelTrainer

    by_config = {"AgenticRunConfig": AgenticTrainer, "ARRunConfig": ARTrainer, "DiffusionRunConfig": DiffusionTrainer,
                 "PERunConfig": PETrainer, "SFTRunConfig": SFTTrainer, "UnifiedRunConfig": UnifiedModelTrainer}
    name = cfg.trainer._target_.rsplit(".", 1)[-1]
    assert name in by_config, f"a recipe with trainer `{name}`: add its trainer class here"
    cls = by_config[name]
    if "async_rollout" in cfg:  # the async trainers' recipes (recipes/async_*.py) are their domain's plus this section
        cls = {ARTrainer: AsyncARTrainer, DiffusionTrainer: AsyncDiffusionTrainer}[cls]
    return cls


def test_the_recipes_are_found():
    assert len(RECIPES) >= 30 and "agentic/qwen2_5/gsm8k_python_vllm.yaml" in RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_recipe_builds_its_trainer_on_the_driver(recipe, folders, monkeypatch, tmp_path):
    text = (ROOT / recipe).read_text()
    monkeypatch.setenv("UNIRL_STORAGE_PATH", str(tmp_path))
    for var in ("PRETRAINED_MODEL", "PRETRAINED_LLM", "PICKSCORE_MODEL", "CLIP_MODEL", "OWL_MODEL", "OCR_MODEL",
                "AESTHETIC_HEAD", "VLM_JUDGE_MODEL", "VLM_JUDGE_URL", "SFT_DATA", "GSM8K_JSONL", "CHART_QA_JSONL"):
        monkeypatch.delenv(var, raising=False)  # the shipped samples where a recipe falls back to one
    real = "oc.env:PRETRAINED_MODEL" in text
    if real:
        monkeypatch.setenv("PRETRAINED_MODEL", str(model_folder(recipe, folders)))
    if "oc.env:PRETRAINED_LLM" in text:
        monkeypatch.setenv("PRETRAINED_LLM", str(folders["qwen2"]))
    for var in ("PICKSCORE_MODEL", "CLIP_MODEL", "OWL_MODEL", "OCR_MODEL", "AESTHETIC_HEAD", "VLM_JUDGE_MODEL"):
        if var in text:
            monkeypatch.setenv(var, str(folders["reward_model"]))
    if "VLM_JUDGE_URL" in text:
        monkeypatch.setenv("VLM_JUDGE_URL", "http://127.0.0.1:8000/v1")
    if "SFT_DATA" in text:
        monkeypatch.setenv("SFT_DATA", str(folders["records"]))
    cfg = load_recipe(str(ROOT / recipe))
    trainer = trainer_class(cfg)(cfg)
    assert trainer.is_demo() == (not real), recipe  # the real ones load the folder given
    assert os.path.realpath(str(trainer.run_cfg.storage_path)).startswith(os.path.realpath(str(tmp_path)))
