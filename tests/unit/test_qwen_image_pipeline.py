"""Tiny Qwen-Image: offline build, the diffusers pipeline's own packing / schedule / text conditioning / true CFG /
denoising / decoding reproduced (with prompts padded to a fixed length), Flow-GRPO sampling with exactly
recomputable log-probs (ratio 1 at step start), save / load, and its recipe."""

import os

import numpy as np
import pytest
import torch

from unirl_ray.models.flux.pipeline import pack, unpack
from unirl_ray.models.qwen_image import QwenImageBundle, QwenImagePipeline, QwenImagePipelineConfig, TinyQwenImageConfig
from unirl_ray.models.qwen_image.bundle import template_prefix_tokens
from unirl_ray.models.qwen_image.pipeline import NEGATIVE_PROMPT
from unirl_ray.models.qwen_image.tiny import build_tiny_qwen_image_pipeline

STEPS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["a red cat", "a blue dog on a long and winding road", "a tree"]


@pytest.fixture(scope="module")
def bundle():
    return QwenImageBundle.from_config(QwenImagePipelineConfig())


@pytest.fixture(scope="module")
def pipe(bundle):
    return QwenImagePipeline(bundle, num_inference_steps=STEPS, height=32, width=32, guidance_scale=1.0,
                             max_sequence_length=64)


@pytest.fixture(scope="module")
def sampled(pipe):
    return pipe.sample(PROMPTS, [11, 22, 33])


def test_tiny_model_builds_offline_and_is_seeded(bundle):
    assert bundle.is_demo and not bundle.transformer.config.guidance_embeds
    assert all(not p.requires_grad for m in bundle.frozen_modules() for p in m.parameters())
    assert all(p.requires_grad for p in bundle.transformer.parameters())
    again = build_tiny_qwen_image_pipeline(TinyQwenImageConfig(seed=0)).transformer.state_dict()
    other = build_tiny_qwen_image_pipeline(TinyQwenImageConfig(seed=1)).transformer.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in bundle.transformer.state_dict().items())
    assert any(not torch.equal(v, other[k]) for k, v in again.items())
    # the template's system turn and "<|im_start|>user\n" are what encode_prompt drops: the user's text is next
    pipe = bundle.diffusers_pipeline()
    ids = pipe.tokenizer(pipe.prompt_template_encode.format("a red cat"))["input_ids"]
    assert pipe.tokenizer.decode(ids[template_prefix_tokens(pipe):]).startswith("a red cat<|im_end|>")
    with pytest.raises(ValueError, match="multiple of 16"):
        TinyQwenImageConfig(text_hidden_size=40)


def test_schedule_is_the_diffusers_pipelines(pipe):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sched = FlowMatchEulerDiscreteScheduler.from_config(pipe.bundle.scheduler.config)
    c = sched.config
    assert c.time_shift_type == "exponential" and c.use_dynamic_shifting
    mu = calculate_shift(pipe.image_tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    assert pipe.image_tokens == 16 and pipe.latent_shape == (4, 8, 8)
    assert torch.allclose(pipe.sigmas, sched.sigmas.float(), atol=1e-6) and pipe.sigmas[-1] == 0.0
    with pytest.raises(ValueError, match="multiples of 8"):
        QwenImagePipeline(pipe.bundle, height=36, width=32)
    with pytest.raises(ValueError, match="<= 1024"):
        QwenImagePipeline(pipe.bundle, height=32, width=32, max_sequence_length=2048)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_ode_sampling_and_decoding_are_the_diffusers_pipelines(bundle, scale):
    """With only ODE steps, our sampler from the same initial latents lands where diffusers' QwenImagePipeline
    does and decodes to its images: same packing, text conditioning (ours padded to 64 tokens and masked, the
    official one to the batch's longest prompt), true CFG with its rescale, schedule and Euler steps, VAE
    normalisation."""
    ode = QwenImagePipeline(bundle, num_inference_steps=STEPS, height=32, width=32, max_sequence_length=64,
                            guidance_scale=scale, sde_window_size=0)
    results = ode.sample(PROMPTS[:2], [5, 6])
    start = torch.stack([part.latents[0] for part, _ in results])
    official = bundle.diffusers_pipeline()
    kwargs = dict(height=32, width=32, num_inference_steps=STEPS, max_sequence_length=64, latents=pack(start.clone()),
                  true_cfg_scale=scale, negative_prompt=NEGATIVE_PROMPT if scale > 1 else None)
    out = official(PROMPTS[:2], output_type="latent", **kwargs).images
    for i, (part, image) in enumerate(results):
        assert torch.allclose(unpack(out, 8, 8)[i], part.latents[-1], atol=1e-5), (scale, i)
        assert torch.isnan(part.log_probs).all()  # ODE steps are recorded with log-prob NaN and never trained
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    images = official(PROMPTS[:2], output_type="np", **kwargs).images  # [B, H, W, 3] floats in [0, 1]
    ours = np.stack([image for _, image in results]).astype(np.float64) / 255
    assert np.abs(ours - images).max() <= 0.5 / 255 + 1e-6


def test_sample_shapes_and_recomputed_log_probs_match_recorded(pipe, bundle, sampled):
    part, image = sampled[0]
    assert part.latents.shape == (STEPS + 1, 4, 8, 8) and part.log_probs.shape == (STEPS,)
    assert part.cond["prompt_embeds"].shape == (64, 32) and part.cond["prompt_mask"].shape == (64,)
    # the mask covers the prompt's own tokens: the longer prompt has more
    assert 0 < int(part.cond["prompt_mask"].sum()) < int(sampled[1][0].cond["prompt_mask"].sum()) < 64
    assert image.shape == (32, 32, 3) and torch.isfinite(part.log_probs).all()
    batch = pipe.collate([p for p, _ in sampled])
    for j in range(STEPS):  # the ratio is 1 at step start: the trainer recomputes what the sampler recorded
        lp, mean, std = pipe.step_log_prob(bundle.transformer, batch, torch.full((3,), j))
        assert lp.requires_grad and mean.shape == (3, 4, 8, 8)
        assert torch.allclose(lp, batch["log_probs"][:, j], atol=1e-5, rtol=0)
    lp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.transformer.parameters())
    bundle.transformer.zero_grad(set_to_none=True)
    alone, _ = pipe.sample([PROMPTS[1]], [22])[0]  # a sample depends on its seed only, not on its batch
    assert torch.allclose(alone.latents, sampled[1][0].latents, atol=1e-5)


def test_cfg_sampling_and_recomputation_agree_and_images_encode_back(bundle):
    pipe = QwenImagePipeline(bundle, num_inference_steps=2, height=32, width=32, guidance_scale=3.0, max_sequence_length=64)
    parts = [p for p, _ in pipe.sample(["a", "b"], [1, 2])]
    assert "negative_prompt_embeds" in parts[0].cond and "negative_prompt_mask" in parts[0].cond
    batch = pipe.collate(parts)
    for j in range(2):
        lp, _, _ = pipe.step_log_prob(bundle.transformer, batch, torch.full((2,), j))
        assert torch.allclose(lp, batch["log_probs"][:, j], atol=1e-5, rtol=0)
    # encode_images is decode's inverse in the VAE's normalised space: the posterior mode of decoded latents
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    z = pipe.encode_images(pixels)
    vae = bundle.vae
    raw = vae.encode(pixels[:, :, None]).latent_dist.mode()[:, :, 0]
    mean, std = pipe._latent_stats()
    assert z.shape == (2, 4, 8, 8) and torch.allclose(z * std + mean, raw, atol=1e-6)


def test_save_and_load_local_folder_and_the_tiny_recipe(tmp_path):
    build_tiny_qwen_image_pipeline(TinyQwenImageConfig(seed=3)).save_pretrained(tmp_path)
    loaded = QwenImageBundle.from_config(QwenImagePipelineConfig(pretrained_model_ckpt_path=str(tmp_path)))
    assert not loaded.is_demo and loaded.config.latent_factor() == 8
    ref = build_tiny_qwen_image_pipeline(TinyQwenImageConfig(seed=3))
    assert all(torch.equal(v, ref.transformer.state_dict()[k]) for k, v in loaded.transformer.state_dict().items())
    demo = QwenImageBundle.from_config(QwenImagePipelineConfig(seed=3))
    args = dict(num_inference_steps=2, height=32, width=32, max_sequence_length=64)
    a, _ = QwenImagePipeline(loaded, **args).sample(["a cat"], [0])[0]
    b, _ = QwenImagePipeline(demo, **args).sample(["a cat"], [0])[0]
    assert torch.isfinite(a.log_probs).all() and torch.allclose(a.latents, b.latents, atol=1e-6)  # the same model

    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    path = os.path.join(ROOT, "recipes", "diffusion", "qwen_image", "qwen_image_tiny_flowgrpo.yaml")
    trainer = DiffusionTrainer(load_recipe(path))
    assert trainer.is_demo() and trainer.recipe.bundle.config._target_.endswith("QwenImagePipelineConfig")
