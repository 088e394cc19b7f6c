"""Tiny SD3: offline build, Flow-GRPO sampling shapes, finite and exactly recomputable log-probs."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from unirl_ray.models.sd3 import SD3Bundle, SD3Pipeline, SD3PipelineConfig, TinySD3Config
from unirl_ray.models.sd3.pipeline import gaussian_log_prob, sde_step_stats
from unirl_ray.models.sd3.tiny import build_tiny_sd3_pipeline

STEPS = 4


@pytest.fixture(scope="module")
def bundle():
    return SD3Bundle.from_config(SD3PipelineConfig())


@pytest.fixture(scope="module")
def pipe(bundle):
    return SD3Pipeline(bundle, num_inference_steps=STEPS, height=32, width=32)


@pytest.fixture(scope="module")
def sampled(pipe):
    return pipe.sample(["a red cat", "a blue dog", "a tree"], [11, 22, 33])


def test_tiny_model_builds_offline_and_is_seeded(bundle):
    assert bundle.is_demo
    n = sum(p.numel() for p in bundle.transformer.parameters())
    assert 1e5 <= n <= 1e6
    assert all(not p.requires_grad for m in bundle.frozen_modules() for p in m.parameters())
    assert all(p.requires_grad for p in bundle.transformer.parameters())
    again = build_tiny_sd3_pipeline(TinySD3Config(seed=0)).transformer.state_dict()
    other = build_tiny_sd3_pipeline(TinySD3Config(seed=1)).transformer.state_dict()
    for k, v in bundle.transformer.state_dict().items():
        assert torch.equal(v, again[k]), k
    assert any(not torch.equal(v, other[k]) for k, v in again.items())


def test_sample_shapes(pipe, sampled):
    assert len(sampled) == 3
    part, image = sampled[0]
    assert part.latents.shape == (STEPS + 1, 4, 16, 16)
    assert part.log_probs.shape == (STEPS,)
    assert part.sigmas.shape == (STEPS + 1,)
    assert part.sigmas[0] == 1.0 and part.sigmas[-1] == 0.0
    assert part.cond["prompt_embeds"].dim() == 2 and part.cond["pooled"].dim() == 1
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert part.num_steps == STEPS


@pytest.mark.parametrize("steps", [1, 2, 8])
def test_log_probs_finite_including_last_step(bundle, steps):
    pipe = SD3Pipeline(bundle, num_inference_steps=steps, height=32, width=32)
    part, image = pipe.sample(["x"], [5])[0]
    assert torch.isfinite(part.log_probs).all() and torch.isfinite(part.latents).all()
    batch = pipe.collate([part])
    lp, mean, std = pipe.step_log_prob(bundle.transformer, batch, torch.tensor([steps - 1]))
    assert torch.isfinite(lp).all() and (std > 0).all()


def test_sde_step_math_hand_computed():
    x, v = torch.full((1, 2), 0.5), torch.full((1, 2), -1.0)
    sigma, sigma_next, second = torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([0.9])
    mean, std = sde_step_stats(x, v, sigma, sigma_next, second, noise_level=0.5)
    # std_t = 0.5 * sqrt(0.5 / 0.5) = 0.5; dt = -0.25
    # mean = 0.5 * (1 + 0.25 / 1 * -0.25) + -1 * (1 + 0.25 * 0.5 / 1) * -0.25 = 0.46875 + 0.28125
    assert torch.allclose(mean, torch.full((1, 2), 0.75))
    assert torch.allclose(std, torch.tensor([0.25]))
    lp = gaussian_log_prob(mean, mean, std)
    assert torch.allclose(lp, torch.tensor([-np.log(0.25) - 0.5 * np.log(2 * np.pi)], dtype=torch.float32))
    # sigma == 1 uses the schedule's second sigma in the denominator: finite std
    _, std1 = sde_step_stats(x, v, torch.tensor([1.0]), torch.tensor([0.9]), second, noise_level=0.7)
    assert torch.isfinite(std1).all()


def test_recomputed_log_probs_match_recorded(pipe, bundle, sampled):
    batch = pipe.collate([p for p, _ in sampled])
    assert batch["latents"].shape == (3, STEPS + 1, 4, 16, 16) and batch["log_probs"].shape == (3, STEPS)
    for j in range(STEPS):
        lp, mean, std = pipe.step_log_prob(bundle.transformer, batch, torch.full((3,), j))
        assert lp.requires_grad and mean.shape == (3, 4, 16, 16) and std.shape == (3,)
        assert torch.allclose(lp, batch["log_probs"][:, j], atol=1e-5, rtol=0)
    mixed = torch.tensor([3, 0, 2])
    lp, _, _ = pipe.step_log_prob(bundle.transformer, batch, mixed)
    assert torch.allclose(lp, batch["log_probs"][torch.arange(3), mixed], atol=1e-5, rtol=0)
    lp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.transformer.parameters())
    bundle.transformer.zero_grad(set_to_none=True)


def test_cfg_sampling_and_recomputation_agree(bundle):
    pipe = SD3Pipeline(bundle, num_inference_steps=2, height=32, width=32, guidance_scale=4.0)
    parts = [p for p, _ in pipe.sample(["a", "b"], [1, 2])]
    assert "negative_prompt_embeds" in parts[0].cond and "negative_pooled" in parts[0].cond
    batch = pipe.collate(parts)
    for j in range(2):
        lp, _, _ = pipe.step_log_prob(bundle.transformer, batch, torch.full((2,), j))
        assert torch.allclose(lp, batch["log_probs"][:, j], atol=1e-5, rtol=0)


def test_same_seed_same_sample_regardless_of_batch(pipe, sampled):
    alone, image = pipe.sample(["a blue dog"], [22])[0]
    ref, ref_image = sampled[1]
    assert torch.allclose(alone.latents, ref.latents, atol=1e-5)
    assert torch.allclose(alone.log_probs, ref.log_probs, atol=1e-5)
    assert np.abs(image.astype(int) - ref_image.astype(int)).max() <= 1
    other, _ = pipe.sample(["a blue dog"], [23])[0]
    assert not torch.allclose(other.latents[0], ref.latents[0])


def test_sampling_leaves_global_rng_and_weights_alone_and_returns_decoded_final_latents(pipe, bundle):
    # sampling speed: bench/sd3_sampling.py
    rng = torch.get_rng_state()
    weights = {k: v.clone() for k, v in bundle.transformer.state_dict().items()}
    grads = [p.grad for p in bundle.transformer.parameters()]
    out = pipe.sample(["a", "b"], [0, 1])
    assert torch.equal(torch.get_rng_state(), rng)  # every draw comes from the per-sample generators
    for k, v in bundle.transformer.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert all(p.grad is g for p, g in zip(bundle.transformer.parameters(), grads))  # no_grad: nothing accumulated
    parts = [p for p, _ in out]
    assert not any(p.latents.requires_grad or p.log_probs.requires_grad for p in parts)
    # the media is the VAE decoding of the last recorded latents (what the reward scores is what was trained)
    decoded = pipe.decode(torch.stack([p.latents[-1] for p in parts]))
    for (_, image), again in zip(out, decoded):
        assert image.shape == again.shape and np.abs(image.astype(int) - again.astype(int)).max() <= 1


def test_bad_settings_raise(bundle):
    with pytest.raises(ValueError, match="multiples of 4"):
        SD3Pipeline(bundle, num_inference_steps=2, height=30, width=32)
    with pytest.raises(ValueError, match="num_inference_steps"):
        SD3Pipeline(bundle, num_inference_steps=0, height=32, width=32)
    with pytest.raises(ValueError, match="noise_level"):
        SD3Pipeline(bundle, num_inference_steps=2, height=32, width=32, noise_level=0.0)
    pipe = SD3Pipeline(bundle, num_inference_steps=2, height=32, width=32)
    with pytest.raises(ValueError, match="one seed per prompt"):
        pipe.sample(["a", "b"], [1])


def test_bad_paths_raise(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist"):
        SD3PipelineConfig(pretrained_model_ckpt_path=str(missing))
    with pytest.raises(ValueError, match="model_index.json"):
        SD3PipelineConfig(pretrained_model_ckpt_path=str(tmp_path))
    with pytest.raises(ValueError, match="torch_dtype"):
        SD3PipelineConfig(torch_dtype="float64")


def test_latent_factor_from_json_only(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    for sub, cfg in {"vae": {"block_out_channels": [8, 16, 32, 64]}, "transformer": {"patch_size": 2}}.items():
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps(cfg))
    cfg = SD3PipelineConfig(pretrained_model_ckpt_path=str(tmp_path))
    assert not cfg.is_demo and cfg.latent_factor() == 16
    cfg.validate_resolution(512, 256)
    with pytest.raises(ValueError, match="multiples of 16"):
        cfg.validate_resolution(520, 512)
    assert SD3PipelineConfig().latent_factor() == 4


def test_save_and_load_local_folder(tmp_path):
    build_tiny_sd3_pipeline(TinySD3Config(seed=3)).save_pretrained(tmp_path)
    bundle = SD3Bundle.from_config(SD3PipelineConfig(pretrained_model_ckpt_path=str(tmp_path)))
    assert not bundle.is_demo and bundle.config.latent_factor() == 4
    ref = build_tiny_sd3_pipeline(TinySD3Config(seed=3)).transformer.state_dict()
    for k, v in bundle.transformer.state_dict().items():
        assert torch.equal(v, ref[k]), k
    part, _ = SD3Pipeline(bundle, num_inference_steps=2, height=32, width=32).sample(["a"], [0])[0]
    assert torch.isfinite(part.log_probs).all()


# ------------------------------------------------------------------ sampling variants (recipe options)


def euler_step(pipe, module, part, j):
    """The ODE step latents[j] -> x + v dt, recomputed from the recorded part."""
    batch = pipe.collate([part])
    x, sigmas = batch["latents"][:, j], batch["sigmas"]
    with torch.no_grad():
        v = pipe.velocity(module, batch, x, sigmas[:, j])
    return x + v * (sigmas[:, j + 1] - sigmas[:, j]).reshape(-1, 1, 1, 1)


def test_sde_window_records_ode_steps_as_nan_and_keeps_exact_log_probs(bundle):
    pipe = SD3Pipeline(bundle, num_inference_steps=6, height=32, width=32, sde_window_size=2, sde_window_range=[1, 5])
    seeds = [3, 4, 5, 6, 7, 8]
    parts = [p for p, _ in pipe.sample(["a"] * len(seeds), seeds)]
    starts = set()
    for part, mask in zip(parts, pipe.sde_steps(seeds)):
        finite = torch.isfinite(part.log_probs)
        assert torch.equal(finite, mask) and int(mask.sum()) == 2
        window = mask.nonzero().flatten().tolist()
        assert window[1] == window[0] + 1 and 1 <= window[0] <= 3
        starts.add(window[0])
        for j in (~mask).nonzero().flatten().tolist():  # outside the window: deterministic Euler steps
            assert torch.allclose(part.latents[j + 1], euler_step(pipe, bundle.transformer, part, j)[0], atol=1e-5)
    assert len(starts) > 1  # the start is drawn per sample
    batch = pipe.collate(parts)
    window = torch.stack([pipe.sde_steps([s])[0].nonzero()[0, 0] for s in seeds])
    lp, _, _ = pipe.step_log_prob(bundle.transformer, batch, window)
    assert torch.allclose(lp, batch["log_probs"][torch.arange(len(seeds)), window], atol=1e-5, rtol=0)
    fixed = SD3Pipeline(bundle, num_inference_steps=6, height=32, width=32, sde_window_size=2, sde_window_range=[2, 4])
    assert fixed.sde_steps(seeds)[:, 2:4].all() and fixed.sde_steps(seeds).sum() == 2 * len(seeds)
    full = SD3Pipeline(bundle, num_inference_steps=6, height=32, width=32)
    assert full.sde_steps(seeds).all()


def test_ode_sampling_is_deterministic_given_the_initial_noise(bundle):
    ode = SD3Pipeline(bundle, num_inference_steps=3, height=32, width=32, sde_window_size=0)
    sde = SD3Pipeline(bundle, num_inference_steps=3, height=32, width=32)
    (part, _), = ode.sample(["a"], [9])
    (noisy, _), = sde.sample(["a"], [9])
    assert torch.isnan(part.log_probs).all() and torch.equal(part.latents[0], noisy.latents[0])
    assert not torch.allclose(part.latents[-1], noisy.latents[-1])
    x = part.latents[0]
    for j in range(3):  # integrate the ODE again from x_0 only
        latents = part.latents.clone()
        latents[j] = x
        x = euler_step(ode, bundle.transformer, dataclasses.replace(part, latents=latents), j)[0]
        assert torch.allclose(x, part.latents[j + 1], atol=1e-5)


def test_shared_initial_noise_within_groups(bundle):
    shared = SD3Pipeline(bundle, num_inference_steps=2, height=32, width=32, share_initial_noise=True)
    assert shared.needs_group_seeds
    assert not SD3Pipeline(bundle, num_inference_steps=2, height=32, width=32).needs_group_seeds
    groups = [11, 11, 12, 12]  # group seeds
    parts = [p for p, _ in shared.sample(["a", "a", "b", "b"], [1, 2, 3, 4], group_seeds=groups)]
    assert torch.equal(parts[0].latents[0], parts[1].latents[0])
    assert torch.equal(parts[2].latents[0], parts[3].latents[0])
    assert not torch.allclose(parts[0].latents[0], parts[2].latents[0])
    assert not torch.allclose(parts[0].latents[1], parts[1].latents[1])  # the SDE noise still differs
    alone = shared.sample(["a"], [7], group_seeds=[11])[0][0]
    assert torch.equal(alone.latents[0], parts[0].latents[0])  # the group's noise, whatever the batch
    with pytest.raises(ValueError, match="group_seeds"):
        shared.sample(["a"], [1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sde_window_size=5), "sde_window_size"),
        (dict(sde_window_size=-1), "sde_window_size"),
        (dict(sde_window_range=[0, 2]), "needs sde_window_size"),
        (dict(sde_window_size=2, sde_window_range=[1, 2]), "hi - lo >= sde_window_size"),
        (dict(sde_window_size=1, sde_window_range=[0, 5]), "lo < hi <= num_inference_steps"),
        (dict(sde_window_size=1, sde_window_range=[0, 1, 2]), "two ints"),
    ],
)
def test_bad_sde_window_settings_raise(bundle, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SD3Pipeline(bundle, num_inference_steps=4, height=32, width=32, **kwargs)
