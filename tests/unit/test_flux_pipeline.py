"""Tiny FLUX: offline build, the diffusers pipeline's own packing / schedule / denoising reproduced, Flow-GRPO
sampling with exactly recomputable log-probs (ratio 1 at step start), CFG, save / load, and its recipe."""

import os

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline as DiffusersFluxPipeline

from unirl_ray.models.flux import FluxBundle, FluxPipeline, FluxPipelineConfig, TinyFluxConfig
from unirl_ray.models.flux.pipeline import pack, unpack
from unirl_ray.models.flux.tiny import build_tiny_flux_pipeline

STEPS = 4
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bundle():
    return FluxBundle.from_config(FluxPipelineConfig())


@pytest.fixture(scope="module")
def pipe(bundle):
    return FluxPipeline(bundle, num_inference_steps=STEPS, height=32, width=32, max_sequence_length=32)


@pytest.fixture(scope="module")
def sampled(pipe):
    return pipe.sample(["a red cat", "a blue dog", "a tree"], [11, 22, 33])


def test_tiny_model_builds_offline_and_is_seeded(bundle):
    assert bundle.is_demo and bundle.transformer.config.guidance_embeds
    assert all(not p.requires_grad for m in bundle.frozen_modules() for p in m.parameters())
    assert all(p.requires_grad for p in bundle.transformer.parameters())
    again = build_tiny_flux_pipeline(TinyFluxConfig(seed=0)).transformer.state_dict()
    other = build_tiny_flux_pipeline(TinyFluxConfig(seed=1)).transformer.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in bundle.transformer.state_dict().items())
    assert any(not torch.equal(v, other[k]) for k, v in again.items())


def test_packing_and_schedule_are_the_diffusers_pipelines(pipe):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from diffusers.schedulers import FlowMatchEulerDiscreteScheduler

    x = torch.randn(2, 4, 16, 16)
    assert torch.equal(pack(x), DiffusersFluxPipeline._pack_latents(x, 2, 4, 16, 16))
    assert torch.equal(unpack(pack(x), 16, 16), x) and torch.equal(DiffusersFluxPipeline._unpack_latents(pack(x), 32, 32, 2), x)
    sched = FlowMatchEulerDiscreteScheduler.from_config(pipe.bundle.scheduler.config)
    c = sched.config
    mu = calculate_shift(64, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    assert torch.allclose(pipe.sigmas, sched.sigmas.float(), atol=1e-6) and pipe.sigmas[-1] == 0.0
    with pytest.raises(ValueError, match="multiples of 4"):
        FluxPipeline(pipe.bundle, height=30, width=32)
    with pytest.raises(ValueError, match="guidance must be > 0"):
        FluxPipeline(pipe.bundle, height=32, width=32, guidance=0.0)


def test_ode_sampling_is_the_diffusers_pipelines_denoising_loop(pipe, bundle):
    """With only ODE steps, our sampler from the same initial latents lands where diffusers' FluxPipeline does
    (same packing, position ids, distilled guidance, schedule, Euler steps)."""
    ode = FluxPipeline(bundle, num_inference_steps=STEPS, height=32, width=32, max_sequence_length=32,
                       sde_window_size=0)
    part, image = ode.sample(["a red cat"], [5])[0]
    out = bundle.diffusers_pipeline()(["a red cat"], height=32, width=32, num_inference_steps=STEPS, guidance_scale=3.5,
                                      max_sequence_length=32, latents=pack(part.latents[:1].clone()),
                                      output_type="latent").images
    assert torch.allclose(unpack(out, 16, 16)[0], part.latents[-1], atol=1e-4)
    assert torch.isnan(part.log_probs).all()  # ODE steps are recorded with log-prob NaN and never trained
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8


def test_sample_shapes_and_recomputed_log_probs_match_recorded(pipe, bundle, sampled):
    part, image = sampled[0]
    assert part.latents.shape == (STEPS + 1, 4, 16, 16) and part.log_probs.shape == (STEPS,)
    assert part.cond["prompt_embeds"].shape == (32, 32) and part.cond["pooled"].shape == (16,)
    assert image.shape == (32, 32, 3) and torch.isfinite(part.log_probs).all()
    batch = pipe.collate([p for p, _ in sampled])
    for j in range(STEPS):  # the ratio is 1 at step start: the trainer recomputes what the sampler recorded
        lp, mean, std = pipe.step_log_prob(bundle.transformer, batch, torch.full((3,), j))
        assert lp.requires_grad and mean.shape == (3, 4, 16, 16)
        assert torch.allclose(lp, batch["log_probs"][:, j], atol=1e-5, rtol=0)
    lp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.transformer.parameters())
    bundle.transformer.zero_grad(set_to_none=True)
    alone, _ = pipe.sample(["a blue dog"], [22])[0]  # a sample depends on its seed only, not on its batch
    assert torch.allclose(alone.latents, sampled[1][0].latents, atol=1e-5)


def test_cfg_sampling_and_recomputation_agree(bundle):
    pipe = FluxPipeline(bundle, num_inference_steps=2, height=32, width=32, guidance_scale=3.0, max_sequence_length=32)
    parts = [p for p, _ in pipe.sample(["a", "b"], [1, 2])]
    assert "negative_prompt_embeds" in parts[0].cond and "negative_pooled" in parts[0].cond
    batch = pipe.collate(parts)
    for j in range(2):
        lp, _, _ = pipe.step_log_prob(bundle.transformer, batch, torch.full((2,), j))
        assert torch.allclose(lp, batch["log_probs"][:, j], atol=1e-5, rtol=0)


def test_save_and_load_local_folder_and_the_tiny_recipe(tmp_path):
    build_tiny_flux_pipeline(TinyFluxConfig(seed=3)).save_pretrained(tmp_path)
    loaded = FluxBundle.from_config(FluxPipelineConfig(pretrained_model_ckpt_path=str(tmp_path)))
    assert not loaded.is_demo and loaded.config.latent_factor() == 4
    ref = build_tiny_flux_pipeline(TinyFluxConfig(seed=3)).transformer.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.transformer.state_dict().items())
    part, _ = FluxPipeline(loaded, num_inference_steps=2, height=32, width=32, max_sequence_length=32).sample(["a"], [0])[0]
    assert torch.isfinite(part.log_probs).all()

    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    trainer = DiffusionTrainer(load_recipe(os.path.join(ROOT, "recipes", "diffusion", "flux", "flux_tiny_flowgrpo.yaml")))
    assert trainer.is_demo() and trainer.recipe.bundle.config._target_.endswith("FluxPipelineConfig")
