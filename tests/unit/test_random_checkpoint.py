"""``unirl_ray.tools.random_checkpoint``: published architectures, folders the real recipes accept,
and (GPU only) the full-size device check of the real diffusion recipes."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from unirl_ray.rewards.geneval import requirements
from unirl_ray.rewards.ocr import quoted_text
from unirl_ray.tools.random_checkpoint import (
    FAMILIES,
    build_pipeline,
    count_parameters,
    write_checkpoint,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Parameter counts of the published checkpoints' components (billions): the SD3.5 Medium MMDiT-X
# transformer as diffusers counts it (marketed as "2.5B"), CLIP ViT-L/14 and OpenCLIP bigG/14 text
# towers with projections, the T5 v1.1 XXL and UMT5-XXL encoders, the Wan2.1 T2V 1.3B transformer, FLUX.1-dev's
# transformer (12B as marketed), its 16-channel VAE and its CLIP-L text tower without projection, Qwen-Image's
# transformer (20B as marketed), its VAE (Wan2.1's architecture) and Qwen2.5-VL-7B with its vision tower.
PUBLISHED = {
    "sd3.5-medium": {"transformer": 2.24, "text_encoder": 0.124, "text_encoder_2": 0.695, "text_encoder_3": 4.76},
    "wan2.1-t2v-1.3b": {"transformer": 1.42, "vae": 0.127, "text_encoder": 5.68},
    "flux.1-dev": {"transformer": 11.90, "vae": 0.0838, "text_encoder": 0.123, "text_encoder_2": 4.76},
    "qwen-image": {"transformer": 20.43, "vae": 0.127, "text_encoder": 8.29},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_architectures_have_the_published_parameter_counts(family):
    counts = count_parameters(build_pipeline(family, device="meta"), family)
    for component, billions in PUBLISHED[family].items():
        assert counts[component] == pytest.approx(billions * 1e9, rel=0.01), (component, counts[component])


def _real_recipes():
    from unirl_ray.trainer.async_rl import AsyncDiffusionTrainer
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    return [
        ("sd3.5-medium", "sd3/sd3_5_medium_flowgrpo.yaml", DiffusionTrainer),
        ("sd3.5-medium", "sd3/sd3_5_medium_nft.yaml", DiffusionTrainer),
        ("sd3.5-medium", "sd3/sd3_5_medium_flowgrpo_async.yaml", AsyncDiffusionTrainer),
        ("sd3.5-medium", "sd3/sd3_5_medium_pickscore_flowgrpo.yaml", DiffusionTrainer),
        ("sd3.5-medium", "sd3/sd3_5_medium_ocr_flowgrpo.yaml", DiffusionTrainer),
        ("sd3.5-medium", "sd3/sd3_5_medium_vlm_judge_flowgrpo.yaml", DiffusionTrainer),
        ("sd3.5-medium", "sd3/sd3_5_medium_geneval_flowgrpo.yaml", DiffusionTrainer),
        ("wan2.1-t2v-1.3b", "wan/wan2_1_t2v_1_3b_flowgrpo.yaml", DiffusionTrainer),
        ("wan2.1-t2v-1.3b", "wan/wan2_1_t2v_1_3b_video_reward_flowgrpo.yaml", DiffusionTrainer),
        ("flux.1-dev", "flux/flux1_dev_pickscore_flowgrpo.yaml", DiffusionTrainer),
        ("qwen-image", "qwen_image/qwen_image_pickscore_flowgrpo.yaml", DiffusionTrainer),
    ]


def test_configs_only_folders_pass_the_real_recipes_checks(tmp_path, monkeypatch):
    from unirl_ray.config.recipe import RecipeError, load_recipe

    folders = {}
    for family in FAMILIES:
        info = write_checkpoint(family, str(tmp_path / family), configs_only=True)
        assert info["bytes"] < 2_000_000 and info["configs_only"]
        folder = tmp_path / family
        index = json.loads((folder / "model_index.json").read_text())
        for component in FAMILIES[family].modules:
            assert component in index and (folder / component / "config.json").is_file()
        assert not list(folder.rglob("*.safetensors"))
        folders[family] = str(folder)
    for name in ("PICKSCORE_MODEL", "CLIP_MODEL", "AESTHETIC_HEAD", "OCR_MODEL", "OWL_MODEL"):  # the reward models' folders (read by their replicas)
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("VLM_JUDGE_URL", "http://127.0.0.1:9/v1")  # a judge endpoint (not called here)
    monkeypatch.setenv("VLM_JUDGE_MODEL", "judge")
    for family, recipe, trainer_cls in _real_recipes():
        monkeypatch.setenv("PRETRAINED_MODEL", folders[family])
        trainer = trainer_cls(load_recipe(os.path.join(ROOT, "recipes", "diffusion", recipe)))
        assert not trainer.is_demo()
        if "pickscore" in recipe:  # each reward model in its own Serve app
            want = {"-pickscore", "-aesthetic"} if "sd3" in recipe else {"-pickscore"}
            assert {suffix for suffix, _ in trainer.reward_cfg.placements()} >= want
        if "flux" in recipe:  # the folder's 8x VAE and the 2 x 2 packing: 16 pixels per token side
            assert trainer.bundle_cfg.latent_factor() == 16 and trainer.recipe.pipeline.guidance == 3.5
        if "qwen_image" in recipe:  # the same geometry from its causal VAE's config; true CFG
            assert trainer.bundle_cfg.latent_factor() == 16 and trainer.recipe.pipeline.guidance_scale == 4.0
        if "ocr" in recipe:  # the OCR model in its own app; every prompt quotes the text it asks for
            assert [suffix for suffix, _ in trainer.reward_cfg.placements()] == ["-ocr"]
            with open(trainer.data.path) as prompts:  # read here: the source's own reader would start Ray
                assert all(quoted_text(line) for line in prompts if line.strip())
        if "video_reward" in recipe:  # per-frame PickScore and the temporal term, each in its own app
            assert {suffix for suffix, _ in trainer.reward_cfg.placements()} == {"-pickscore", "-consistency"}
        if "geneval" in recipe:  # the detector in its own app; every shipped prompt carries valid metadata
            assert [suffix for suffix, _ in trainer.reward_cfg.placements()] == ["-geneval"]
            with open(trainer.data.path) as prompts:
                assert all(requirements(json.loads(line)["metadata"]) for line in prompts if line.strip())
        if "vlm_judge" in recipe:  # a function reward: the judge is called from the driver's process
            assert trainer.reward_cfg.shared_runs_locally() and not trainer.reward_cfg.resources()
    # the prompt enhancer's real recipe: a Qwen2.5 rewriter folder, SD3.5 Medium, a CLIP folder
    from unirl_ray.trainer.pe import PETrainer

    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    monkeypatch.setenv("PRETRAINED_MODEL", folders["sd3.5-medium"])
    monkeypatch.setenv("PRETRAINED_LLM", str(tmp_path / "llm"))
    monkeypatch.setenv("CLIP_MODEL", str(tmp_path / "clip"))
    pe = PETrainer(load_recipe(os.path.join(ROOT, "recipes", "pe", "qwen2_5", "qwen0_5b_sd3_5_medium.yaml")))
    assert not pe.is_demo() and pe.trained_sides == ["ar", "diffusion"]
    assert (pe.rewrites_per_prompt, pe.images_per_rewrite) == (4, 4) and "lora_cfg" in pe.backend_cfgs["diffusion"]
    with pytest.raises(RecipeError, match="diffusion.pipeline.height=520 must be a positive multiple of 16"):
        PETrainer(load_recipe(os.path.join(ROOT, "recipes", "pe", "qwen2_5", "qwen0_5b_sd3_5_medium.yaml"),
                              ["diffusion.pipeline.height=520"]))
    # the checks really read the folder: a resolution the SD3.5 VAE x patch size cannot tile is refused
    monkeypatch.setenv("PRETRAINED_MODEL", folders["sd3.5-medium"])
    with pytest.raises(RecipeError, match="multiple of 16"):
        from unirl_ray.trainer.diffusion import DiffusionTrainer

        DiffusionTrainer(load_recipe(os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_5_medium_flowgrpo.yaml"),
                                     ["pipeline.height=520"]))


def test_refuses_to_overwrite_a_folder_and_unknown_families(tmp_path):
    write_checkpoint("sd3.5-medium", str(tmp_path), configs_only=True)
    with pytest.raises(FileExistsError, match="already holds"):
        write_checkpoint("sd3.5-medium", str(tmp_path), configs_only=True)
    with pytest.raises(ValueError, match="sd3.5-medium"):
        write_checkpoint("sd3-large", str(tmp_path / "x"), configs_only=True)


def test_the_device_check_runs_every_case_on_the_tiny_twins(tmp_path):
    """bench/gpu_real_checkpoint.py --tiny: the script a lent GPU runs, on the CPU with each case's tiny recipe twin
    and the case's own overrides, so that it does not rot between the sessions that have a GPU (~7 s)."""
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_real_checkpoint.py"), "--tiny", "--steps", "1",
                    "--json-out", str(out)], check=True, timeout=600, capture_output=True)
    cases = json.loads(out.read_text())["cases"]
    assert {c["case"] for c in cases} >= {"sd3.5m-flowgrpo-lora", "flux.1-dev-flowgrpo-lora", "qwen-image-flowgrpo-lora"}
    for case in cases:
        assert "error" not in case and [s["policy_version"] for s in case["steps"]] == [1], case
        assert case["trainable_params"] > 0 and math.isfinite(case["steps"][0]["train/loss"]), case
        if "flowgrpo" in case["case"]:  # rollout and trainer log-probs agree at step start (NFT records none)
            assert abs(case["steps"][0]["rollout/logp_gap"]) < 1e-4, case


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_full_size_sd35_medium_recipe_trains_on_a_gpu(tmp_path):
    """The device check (bench/gpu_real_checkpoint.py) for one case: full-size weights, FSDP2 in bf16,
    LoRA, rollout, two steps with the colocated offload turn between them, export and reload."""
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_real_checkpoint.py"), "--cases",
                    "sd3.5m-flowgrpo-lora", "--steps", "2", "--workdir", str(tmp_path / "work"),
                    "--json-out", str(out)], check=True, timeout=900)
    (case,) = json.loads(out.read_text())["cases"]
    assert case["fsdp2_wrapped"] and case["export_reloaded_params"] == 2243171520
    assert [s["policy_version"] for s in case["steps"]] == [1, 2]
    assert case["steps"][1]["offload"]["resident_after_offload_gib"] == 0.0
    assert case["steps"][1]["offload"]["allocated_drop_gib"] >= 0.9 * case["steps"][1]["offload"]["offloaded_gib"]
    assert all(abs(s["rollout/logp_gap"]) < 1e-3 for s in case["steps"])
