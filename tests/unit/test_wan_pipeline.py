"""Tiny Wan text-to-video: offline build, time-axis shapes, exact log-prob recomputation, clip-shape
checks, the real recipe validated against a folder of JSON configs, and GIF / frame-strip media."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from unirl_ray.config.recipe import RecipeError, load_recipe
from unirl_ray.models.wan import TinyWanConfig, WanBundle, WanPipeline, WanPipelineConfig
from unirl_ray.models.wan.tiny import build_tiny_wan_pipeline
from unirl_ray.rewards.image import brightness
from unirl_ray.tracking.media import frame_strip, write_gif

STEPS = 3
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
REAL = os.path.join(ROOT, "recipes", "diffusion", "wan", "wan2_1_t2v_1_3b_flowgrpo.yaml")


@pytest.fixture(scope="module")
def bundle():
    return WanBundle.from_config(WanPipelineConfig())


@pytest.fixture(scope="module")
def pipe(bundle):
    return WanPipeline(bundle, num_inference_steps=STEPS, num_frames=5, height=16, width=16, max_sequence_length=16)


@pytest.fixture(scope="module")
def sampled(pipe):
    return pipe.sample(["a red cat", "a blue dog", "a tree"], [11, 22, 33])


def test_tiny_model_builds_offline_and_is_seeded(bundle):
    assert bundle.is_demo
    assert all(not p.requires_grad for m in bundle.frozen_modules() for p in m.parameters())
    assert all(p.requires_grad for p in bundle.transformer.parameters())
    assert type(bundle.transformer.blocks[0]).__name__ == "WanTransformerBlock"  # the recipes' FSDP block class
    again = build_tiny_wan_pipeline(TinyWanConfig(seed=0)).transformer.state_dict()
    other = build_tiny_wan_pipeline(TinyWanConfig(seed=1)).transformer.state_dict()
    for k, v in bundle.transformer.state_dict().items():
        assert torch.equal(v, again[k]), k
    assert any(not torch.equal(v, other[k]) for k, v in again.items())


def test_sample_shapes_carry_a_time_axis(pipe, sampled):
    # 5 frames -> (5 - 1) / 2 + 1 = 3 latent frames; 16 px / spatial factor 2 = 8
    assert pipe.latent_shape == (4, 3, 8, 8)
    part, frames = sampled[0]
    assert part.latents.shape == (STEPS + 1, 4, 3, 8, 8)
    assert part.log_probs.shape == (STEPS,) and torch.isfinite(part.log_probs).all()
    assert part.sigmas.shape == (STEPS + 1,) and part.sigmas[0] == 1.0 and part.sigmas[-1] == 0.0
    assert part.cond["prompt_embeds"].shape == (16, 32)
    assert frames.shape == (5, 16, 16, 3) and frames.dtype == np.uint8
    # the image reward contract takes frames: brightness is the mean over frames
    assert brightness(images=[frames], prompts=["x"])[0] == pytest.approx(frames.mean() / 255.0)


def test_recomputed_log_probs_match_recorded(pipe, bundle, sampled):
    batch = pipe.collate([p for p, _ in sampled])
    assert batch["latents"].shape == (3, STEPS + 1, 4, 3, 8, 8)
    for j in range(STEPS):
        lp, mean, std = pipe.step_log_prob(bundle.transformer, batch, torch.full((3,), j))
        assert lp.requires_grad and mean.shape == (3, 4, 3, 8, 8) and std.shape == (3,)
        ratio = torch.exp(lp - batch["log_probs"][:, j])
        assert torch.allclose(ratio, torch.ones(3), atol=1e-5, rtol=0), ratio
    mixed = torch.tensor([2, 0, 1])
    lp, _, _ = pipe.step_log_prob(bundle.transformer, batch, mixed)
    assert torch.allclose(lp, batch["log_probs"][torch.arange(3), mixed], atol=1e-5, rtol=0)
    lp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.transformer.parameters())
    bundle.transformer.zero_grad(set_to_none=True)


def test_cfg_sampling_and_recomputation_agree(bundle):
    pipe = WanPipeline(bundle, num_inference_steps=2, num_frames=3, height=16, width=16, max_sequence_length=8,
                       guidance_scale=3.0)
    parts = [p for p, _ in pipe.sample(["a", "b"], [1, 2])]
    assert set(parts[0].cond) == {"prompt_embeds", "negative_prompt_embeds"}
    batch = pipe.collate(parts)
    for j in range(2):
        lp, _, _ = pipe.step_log_prob(bundle.transformer, batch, torch.full((2,), j))
        assert torch.allclose(lp, batch["log_probs"][:, j], atol=1e-5, rtol=0)


def test_same_seed_same_video_regardless_of_batch(pipe, sampled):
    alone, frames = pipe.sample(["a blue dog"], [22])[0]
    assert torch.allclose(alone.latents, sampled[1][0].latents, atol=1e-5)
    assert np.abs(frames.astype(int) - sampled[1][1].astype(int)).max() <= 1


@pytest.mark.parametrize("frames", [0, 2, 4, 6])
def test_bad_frame_counts_rejected(bundle, frames):
    with pytest.raises(ValueError, match=r"num_frames=\d+ must be 1 \+ a multiple of 2"):
        WanPipeline(bundle, num_inference_steps=2, num_frames=frames, height=16, width=16)


def test_bad_resolution_rejected(bundle):
    with pytest.raises(ValueError, match="multiples of 4"):
        WanPipeline(bundle, num_inference_steps=2, num_frames=5, height=18, width=16)


def _wan21_folder(path):
    """model_index.json + the vae / transformer config.json of Wan2.1-T2V-1.3B-Diffusers (no weights)."""
    (path / "vae").mkdir()
    (path / "transformer").mkdir()
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None], "vae": ["diffusers", "AutoencoderKLWan"],
    }))
    (path / "vae" / "config.json").write_text(json.dumps({
        "_class_name": "AutoencoderKLWan", "base_dim": 96, "dim_mult": [1, 2, 4, 4], "z_dim": 16,
        "temperal_downsample": [False, True, True], "num_res_blocks": 2,
    }))
    (path / "transformer" / "config.json").write_text(json.dumps({
        "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_layers": 30, "in_channels": 16,
    }))


def test_real_config_geometry_from_json_only(tmp_path):
    _wan21_folder(tmp_path)
    cfg = WanPipelineConfig(pretrained_model_ckpt_path=str(tmp_path), torch_dtype="bfloat16")
    g = cfg.geometry()
    assert (g.temporal, g.spatial, g.patch, g.latent_channels) == (4, 8, (1, 2, 2), 16)
    assert cfg.latent_factor() == 16 and g.latent_frames(81) == 21
    cfg.validate_video(33, 480, 832)
    with pytest.raises(ValueError, match="e.g. use 33 or 37"):
        cfg.validate_video(35, 480, 832)
    with pytest.raises(ValueError, match="multiples of 16"):
        cfg.validate_video(33, 488, 832)


def test_real_recipe_validates_on_the_driver(monkeypatch, tmp_path):
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    _wan21_folder(tmp_path)
    monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path))
    trainer = DiffusionTrainer(load_recipe(REAL))
    assert not trainer.is_demo() and trainer.group_size == 8
    recipe = trainer.recipe.pipeline
    trainer.bundle_cfg.validate_video(recipe.num_frames, recipe.height, recipe.width)
    with pytest.raises(RecipeError, match="multiple of 16"):
        DiffusionTrainer(load_recipe(REAL, ["pipeline.width=840"]))


def test_bad_paths_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        WanPipelineConfig(pretrained_model_ckpt_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="model_index.json"):
        WanPipelineConfig(pretrained_model_ckpt_path=str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    with pytest.raises(ValueError, match="two-expert"):
        WanPipelineConfig(pretrained_model_ckpt_path=str(tmp_path))
    with pytest.raises(ValueError, match="vae_torch_dtype"):
        WanPipelineConfig(vae_torch_dtype="float64")


def test_save_and_load_local_folder(bundle, tmp_path):
    bundle.save_pretrained(str(tmp_path))
    loaded = WanBundle.from_config(WanPipelineConfig(pretrained_model_ckpt_path=str(tmp_path)))
    assert not loaded.is_demo
    for k, v in bundle.transformer.state_dict().items():
        assert torch.equal(v, loaded.transformer.state_dict()[k]), k
    a = WanPipeline(bundle, num_inference_steps=2, num_frames=3, height=16, width=16, max_sequence_length=8)
    b = WanPipeline(loaded, num_inference_steps=2, num_frames=3, height=16, width=16, max_sequence_length=8)
    pa, pb = a.sample(["x"], [3])[0][0], b.sample(["x"], [3])[0][0]
    assert torch.allclose(pa.latents, pb.latents, atol=1e-5)


def test_encode_videos_inverts_decode_shapes(pipe):
    pixels = torch.rand(2, 3, 5, 16, 16) * 2 - 1
    z = pipe.encode_videos(pixels)
    assert z.shape == (2, *pipe.latent_shape) and z.dtype == torch.float32
    assert pipe.decode(z).shape == (2, 5, 16, 16, 3)


def test_gif_has_every_frame_and_strip_is_side_by_side(tmp_path):
    rng = np.random.default_rng(0)
    video = rng.integers(0, 256, size=(7, 12, 10, 3), dtype=np.uint8)
    path = write_gif(video, tmp_path / "v.gif", fps=10)
    with Image.open(path) as gif:
        assert gif.format == "GIF" and gif.is_animated and gif.n_frames == 7
        assert gif.size == (10, 12) and gif.info["duration"] == 100 and gif.info["loop"] == 0
        gif.seek(3)
        # GIF quantises to 256 colours: the frame is close to, not equal to, the source
        assert np.abs(np.asarray(gif.convert("RGB"), dtype=int) - video[3].astype(int)).mean() < 40
    strip = frame_strip(video, gap=1)
    assert strip.size == (7 * 10 + 6, 12)
    assert np.array_equal(np.asarray(strip)[:, 11:21], video[1])
    with pytest.raises(ValueError, match="fps"):
        write_gif(video, tmp_path / "bad.gif", fps=0)


def test_log_videos_writes_gif_and_strip_artifacts(tmp_path):
    from mlflow import MlflowClient

    from unirl_ray.tracking import MLflowTracker, TrackingConfig
    from unirl_ray.tracking.media import log_videos

    tracker = MLflowTracker(TrackingConfig(experiment_name="media"))
    run_id = tracker.start(str(tmp_path), "media")
    videos = [np.random.default_rng(i).integers(0, 256, size=(3, 8, 8, 3), dtype=np.uint8) for i in range(2)]
    log_videos(tracker, 6, videos, ["a | r=0.5", "b | r=0.4"], key="samples", fps=4)
    client = MlflowClient(tracker.tracking_uri)
    files = sorted(a.path for a in client.list_artifacts(run_id, "samples/step_000006"))
    assert files == [f"samples/step_000006/{n}" for n in ("00.gif", "00_strip.png", "01.gif", "01_strip.png")]
    with Image.open(client.download_artifacts(run_id, "samples/step_000006/01.gif", str(tmp_path / "dl"))) as gif:
        assert gif.n_frames == 3 and gif.info["duration"] == 250
    with open(client.download_artifacts(run_id, "samples/step_000006.json", str(tmp_path / "dl"))) as f:
        table = json.load(f)
    captions = [row[table["columns"].index("caption")] for row in table["data"]]
    assert captions == ["a | r=0.5", "b | r=0.4"]
    tracker.end()


def test_unipc_checkpoint_scheduler_gives_its_flow_shift_to_the_euler_schedule(bundle):
    """Wan2.1 folders ship a UniPC scheduler; the SDE uses plain shifted flow-matching sigmas."""
    import dataclasses

    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    pipe = WanPipeline(dataclasses.replace(bundle, scheduler=unipc), num_inference_steps=4, num_frames=5,
                       height=16, width=16, max_sequence_length=8)
    euler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    euler.set_timesteps(4)
    assert torch.allclose(pipe.sigmas, euler.sigmas.float())
    # shift 5 keeps sigmas higher than the tiny model's shift 3 at the same step
    assert pipe.sigmas[2] > WanPipeline(bundle, num_inference_steps=4, num_frames=5, height=16, width=16).sigmas[2]
