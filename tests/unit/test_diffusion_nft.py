"""DiffusionNFT: reward -> optimality mapping, hand-computed loss, wiring on a fake pipeline, shadow-policy
rollouts, a few steps on the tiny SD3 (brightness rises), and the NFT recipes."""

import json
import math
import os
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from unirl_ray.algorithms import DiffusionNFT, LossContext
from unirl_ray.algorithms.diffusion_nft import implicit_policies, optimality_probability, regression_loss
from unirl_ray.core.sample import DiffusionPart, Sample

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TINY_RECIPE = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_tiny_nft.yaml")
REAL_RECIPE = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_5_medium_nft.yaml")


# ------------------------------------------------------------------------------------ pure math


def test_optimality_probability_clips_and_maps_advantages():
    adv = torch.tensor([-10.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.0])
    r = optimality_probability(adv, 5.0)
    assert r.tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0])


def test_implicit_policies_and_losses_hand_computed():
    v_old, v_theta = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 0.0]], requires_grad=True)
    v_pos, v_neg = implicit_policies(v_old, v_theta, beta=0.5)
    assert v_pos.tolist() == [[0.5, 0.0]] and v_neg.tolist() == [[-0.5, 0.0]]
    x0, t, eps = torch.zeros(1, 2), torch.tensor([0.5]), torch.tensor([[2.0, 2.0]])
    x_t, v = (1 - t[:, None]) * x0 + t[:, None] * eps, eps - x0  # x_t = [1, 1], v = [2, 2]
    # plain: mean((v+- - v)^2) = mean(1.5^2, 2^2) = 3.125 and mean(2.5^2, 2^2) = 5.125
    assert regression_loss(v_pos, v, x_t, x0, t, adaptive=False).item() == pytest.approx(3.125)
    assert regression_loss(v_neg, v, x_t, x0, t, adaptive=False).item() == pytest.approx(5.125)
    # adaptive: x0 errors x_t - t v+- - x0 = [0.75, 1] and [1.25, 1]; mean(err^2) / mean|err|
    pos = regression_loss(v_pos, v, x_t, x0, t, adaptive=True)
    neg = regression_loss(v_neg, v, x_t, x0, t, adaptive=True)
    assert pos.item() == pytest.approx(0.78125 / 0.875) and neg.item() == pytest.approx(1.28125 / 1.125)
    # the weight is a constant: d pos / d v_theta = beta * (-t) * 2 err / n / weight = 0.5 * -0.5 * err / 0.875
    pos.backward()
    assert v_theta.grad.tolist() == [pytest.approx([-0.25 * 0.75 / 0.875, -0.25 * 1.0 / 0.875])]


# ------------------------------------------------------------------------------ fake pipeline


class Scale(torch.nn.Module):
    """A 'policy' whose velocity is ``scale * x``."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(value))


class FakePipeline:
    """collate stacks latents / sigmas; velocity = module.scale * x, recording every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []

    def collate(self, parts):
        return {"latents": torch.stack([p.latents for p in parts]), "sigmas": torch.stack([p.sigmas for p in parts])}

    def velocity(self, module, batch, x, sigma):
        self.calls.append((module, x.detach().clone(), sigma.detach().clone()))
        return module.scale * x


def make_samples(advantages, *, steps=4, shape=(3,), groups=None):
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    out = []
    for i, adv in enumerate(advantages):
        g = torch.Generator().manual_seed(100 + i)
        latents = torch.randn(steps + 1, *shape, generator=g)
        part = DiffusionPart(latents=latents, log_probs=torch.full((steps,), math.nan), sigmas=sigmas.clone())
        group = groups[i] if groups else "g"
        out.append(Sample(sample_id=f"s0-{i}", group_id=group, prompt="p", parts=[part], advantage=adv))
    return out


def ctx_for(policy, old, *, reference=None, loss_scale=1.0):
    return LossContext(
        policy=policy,
        reference=None if reference is None else (lambda: nullcontext(reference)),
        shadow_policy=None if old is None else (lambda: nullcontext(old)),
        loss_scale=loss_scale,
        first_pass=True,
    )


def test_loss_wiring_matches_the_formula_on_recorded_inputs():
    """x_t from the chosen sigmas and seeded noise; v_old from the shadow without grad; KL; 1/slots scaling."""
    pipe = FakePipeline()
    algo = DiffusionNFT(group_size=2, beta=0.5, adv_clip_max=2.0, adaptive_weighting=False, timestep_fraction=0.5,
                        kl_beta=0.1, pipeline=pipe)
    samples = make_samples([1.0, -3.0])
    seg = algo.prepare_segment(samples, seed=3)
    policy, old, ref = Scale(1.5), Scale(1.0), Scale(0.5)
    m = algo.compute_loss_and_backward(samples, seg, ctx_for(policy, old, reference=ref, loss_scale=0.5))
    assert m["count"] == 4  # 2 samples x round(4 x 0.5) noise levels
    assert old.scale.grad is None and ref.scale.grad is None
    by_module = {id(mod): [] for mod in (policy, old, ref)}
    for mod, x, sigma in pipe.calls:
        by_module[id(mod)].append((x, sigma))
    assert len(by_module[id(old)]) == len(by_module[id(policy)]) == len(by_module[id(ref)]) == 2  # one per slot

    theta = torch.tensor(1.5, requires_grad=True)
    r = torch.tensor([0.75, 0.0])  # 1/2 + 1/2 clip(A, -2, 2) / 2
    x0 = torch.stack([s.parts[0].latents[-1] for s in samples])
    expected = {"policy_loss": 0.0, "kl": 0.0, "optimality": 0.0}
    total = torch.tensor(0.0)
    for k, (x_t, sigma) in enumerate(by_module[id(policy)]):
        idx = torch.stack([seg["sigma_index"][s.sample_id][k] for s in samples])
        assert torch.equal(sigma, samples[0].parts[0].sigmas[idx])
        eps = (x_t - (1 - sigma[:, None]) * x0) / sigma[:, None]
        v = eps - x0
        v_pos = 0.5 * 1.0 * x_t + 0.5 * theta * x_t
        v_neg = 1.5 * 1.0 * x_t - 0.5 * theta * x_t
        policy_loss = 2.0 / 0.5 * (r * ((v_pos - v) ** 2).mean(1) + (1 - r) * ((v_neg - v) ** 2).mean(1))
        kl = ((theta - 0.5) * x_t).pow(2).mean(1)
        total = total + (policy_loss + 0.1 * kl).mean() * 0.5 / 2
        expected["policy_loss"] += policy_loss.sum().item()
        expected["kl"] += kl.sum().item()
        expected["optimality"] += r.sum().item()
    total.backward()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-5), key
    assert m["loss"] == pytest.approx(expected["policy_loss"] + 0.1 * expected["kl"], rel=1e-5)
    assert policy.scale.grad.item() == pytest.approx(theta.grad.item(), rel=1e-5)
    assert m["old_deviation"] > 0  # theta 1.5 vs old 1.0


def test_noise_levels_and_noise_are_fixed_by_the_step_seed():
    pipe = FakePipeline()
    algo = DiffusionNFT(group_size=2, timestep_fraction=0.3, pipeline=pipe)
    samples = make_samples([0.0] * 6, steps=10)
    seg = algo.prepare_segment(samples, seed=7)
    for s in samples:
        idx = seg["sigma_index"][s.sample_id]
        assert idx.shape == (3,) and len(set(idx.tolist())) == 3 and 0 <= idx.min() and idx.max() < 10
        assert idx.tolist() == sorted(idx.tolist())
    again = algo.prepare_segment(list(reversed(samples[2:])), seed=7)["sigma_index"]
    assert all(torch.equal(again[k], seg["sigma_index"][k]) for k in again)  # independent of the shard
    other = algo.prepare_segment(samples, seed=8)["sigma_index"]
    assert any(not torch.equal(other[k], seg["sigma_index"][k]) for k in other)
    assert DiffusionNFT(group_size=2, timestep_fraction=0.01).num_train_steps(10) == 1

    policy, old = Scale(1.0), Scale(1.0)
    algo.compute_loss_and_backward(samples[:1], seg, ctx_for(policy, old))
    first = [x for mod, x, _ in pipe.calls if mod is policy]
    pipe.calls.clear()
    algo.compute_loss_and_backward(samples[:1], seg, ctx_for(policy, old))
    second = [x for mod, x, _ in pipe.calls if mod is policy]
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # a second epoch revisits the same x_t
    x0 = samples[0].parts[0].latents[-1]
    sig = samples[0].parts[0].sigmas[seg["sigma_index"]["s0-0"]]
    eps = [(x - (1 - s) * x0) / s for x, s in zip(first, sig)]
    assert not torch.allclose(eps[0], eps[1])  # each slot draws its own noise


def test_advantages_global_or_group_std_and_optimality_metrics():
    samples = make_samples([None] * 5, groups=["a", "a", "b", "b", "b"])
    for s, r in zip(samples, [1.0, 3.0, 5.0, 9.0, None]):
        s.reward = r
    algo = DiffusionNFT(group_size=2, adv_clip_max=0.5)
    metrics = algo.compute_advantages(samples)
    std = float(np.std([1.0, 3.0, 5.0, 9.0]))  # of every valid reward of the step
    expected = [-1 / (std + 1e-4), 1 / (std + 1e-4), -2 / (std + 1e-4), 2 / (std + 1e-4), 0.0]
    assert [s.advantage for s in samples] == pytest.approx(expected)
    assert metrics["algo/adv_abs_max"] == pytest.approx(2 / (std + 1e-4))
    assert metrics["algo/adv_clipped_frac"] == pytest.approx(2 / 5)  # |A| = 0.68 >= 0.5 twice
    r = [0.5 + 0.5 * max(-1.0, min(1.0, a / 0.5)) for a in expected]
    assert metrics["algo/optimality_mean"] == pytest.approx(sum(r) / 5)
    assert metrics["algo/invalid_reward_frac"] == pytest.approx(0.2)
    DiffusionNFT(group_size=2, global_std=False).compute_advantages(samples)
    assert [s.advantage for s in samples] == pytest.approx([-1 / 1.0001, 1 / 1.0001, -2 / 2.0001, 2 / 2.0001, 0.0])
    DiffusionNFT(group_size=2, normalize_std=False).compute_advantages(samples)
    assert [s.advantage for s in samples] == [-1.0, 1.0, -2.0, 2.0, 0.0]


def test_config_and_context_errors():
    for kwargs, message in [
        (dict(group_size=1), "group_size"),
        (dict(group_size=2, beta=0.0), "beta"),
        (dict(group_size=2, adv_clip_max=0.0), "adv_clip_max"),
        (dict(group_size=2, timestep_fraction=0.0), "timestep_fraction"),
        (dict(group_size=2, kl_beta=-1.0), "kl_beta"),
    ]:
        with pytest.raises(ValueError, match=message):
            DiffusionNFT(**kwargs)
    assert DiffusionNFT.supports_multi_update and DiffusionNFT.needs_shadow_policy
    assert not DiffusionNFT(group_size=2).needs_reference and DiffusionNFT(group_size=2, kl_beta=0.1).needs_reference
    samples = make_samples([1.0, -1.0])
    algo = DiffusionNFT(group_size=2, kl_beta=0.1, pipeline=FakePipeline())
    seg = algo.prepare_segment(samples, seed=0)
    with pytest.raises(ValueError, match="ema_lora_cfg"):
        algo.compute_loss_and_backward(samples, seg, ctx_for(Scale(1.0), None))
    with pytest.raises(ValueError, match="reference"):
        algo.compute_loss_and_backward(samples, seg, ctx_for(Scale(1.0), Scale(1.0)))
    no_adv = make_samples([None])
    with pytest.raises(ValueError, match="compute_advantages"):
        algo.compute_loss_and_backward(no_adv, algo.prepare_segment(no_adv, seed=0),
                                       ctx_for(Scale(1.0), Scale(1.0), reference=Scale(1.0)))


class NetPipeline(FakePipeline):
    """velocity = the backend's small ``Net`` on latents [B, 3] (zero-padded to its width 5)."""

    def velocity(self, module, batch, x, sigma):
        return module(torch.nn.functional.pad(x, (0, 2)))


def test_stack_hands_the_shadow_to_the_loss_and_a_second_epoch_moves_away_from_it():
    from _dist import make_backend

    from unirl_ray.train.configs import EmaLoraConfig
    from unirl_ray.train.stack import TrainStack

    ema = EmaLoraConfig(rank=2, alpha=2, target_modules=["to_q"], init_lora_weights="gaussian",
                        ema_decay_type="constant", ema_decay=0.5)
    backend = make_backend(ema_lora_cfg=ema)
    algo = DiffusionNFT(group_size=2, pipeline=NetPipeline())
    stack = TrainStack(fsdp_backend=backend, algorithm=algo, micro_batch_size=2, mini_batch_size=4,
                       num_updates_per_batch=2)
    samples = make_samples([1.0, -1.0, 0.5, -0.5])
    shadow_before = [s.detach().clone() for _, s in backend.adapter_ema.pairs()]
    metrics = stack.train(samples, seed=0).metrics
    assert metrics["train/optimizer_steps"] == 2.0
    # epoch 1 runs at v_theta == v_old, epoch 2 after an optimizer step, against the same shadow
    assert metrics["algo/old_deviation"] > 0
    for (live, shadow), old in zip(backend.adapter_ema.pairs(), shadow_before):
        assert torch.allclose(shadow, 0.5 * old + 0.5 * live, atol=1e-7)  # moved only at rollout_end


# ------------------------------------------------------------------------------ tiny SD3


def tiny_nft_stack(*, lr=5e-2, ema_lora_cfg=None, steps=4, group_size=4, micro=8):
    from unirl_ray.models.sd3 import SD3Bundle, SD3Pipeline, SD3PipelineConfig
    from unirl_ray.rollout.trainside import TrainsideRollout
    from unirl_ray.train.backend.fsdp import FSDPBackend
    from unirl_ray.train.configs import EmaLoraConfig, OptimizerConfig, TrainTopology
    from unirl_ray.train.stack import TrainStack

    bundle = SD3Bundle.from_config(SD3PipelineConfig())
    pipe = SD3Pipeline(bundle, num_inference_steps=steps, height=32, width=32, sde_window_size=0)
    ema = ema_lora_cfg or EmaLoraConfig(rank=8, alpha=8, init_lora_weights="gaussian")
    backend = FSDPBackend(block_class_names=["JointTransformerBlock"], trainable_attr="transformer", bundle=bundle,
                          optimizer_cfg=OptimizerConfig(learning_rate=lr, weight_decay=0.0), ema_lora_cfg=ema)
    algo = DiffusionNFT(group_size=group_size, timestep_fraction=1.0, pipeline=pipe)
    stack = TrainStack(fsdp_backend=backend, algorithm=algo, micro_batch_size=micro, mini_batch_size=micro)
    backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
    return pipe, backend, algo, stack, TrainsideRollout(pipeline=pipe, backend=backend)


def requests(step, prompts, group_size):
    return [{"sample_id": f"s{step}-{i}", "group_id": f"s{step}-p{i // group_size}", "prompt": prompts[i // group_size],
             "seed": 1000 * step + i} for i in range(len(prompts) * group_size)]


def test_trainside_rollout_samples_with_the_shadow_adapter():
    from unirl_ray.rollout.trainside import TrainsideRollout

    pipe, backend, _, _, rollout = tiny_nft_stack(steps=2)
    assert rollout.samples_with_shadow
    with torch.no_grad():  # make the trained adapter differ from its shadow
        for live, _ in backend.adapter_ema.pairs():
            live.add_(0.3)
    reqs = requests(0, ["a cat"], 2)
    auto = rollout.generate(reqs, policy_version=0)
    with torch.no_grad(), backend.shadow_policy() as old:
        with_shadow = pipe.sample(["a cat"] * 2, [r["seed"] for r in reqs], module=old)
    current = TrainsideRollout(pipeline=pipe, backend=backend, sampling_policy="trainable")
    trainable = current.generate(reqs, policy_version=0)
    for s, (part, _) in zip(auto, with_shadow):
        assert torch.equal(s.parts[0].latents, part.latents)
    assert not torch.allclose(auto[0].parts[0].latents[-1], trainable[0].parts[0].latents[-1])
    assert torch.isnan(auto[0].parts[0].log_probs).all()  # ODE sampling: no step log-probs
    with torch.no_grad():  # the trained adapter is active again after the rollout
        again = pipe.sample(["a cat"] * 2, [r["seed"] for r in reqs], module=backend.module)[0][0]
    assert torch.equal(again.latents, trainable[0].parts[0].latents)
    with pytest.raises(ValueError, match="sampling_policy"):
        TrainsideRollout(pipeline=pipe, backend=backend, sampling_policy="ema")


def test_stack_refuses_nft_without_the_shadow_adapter():
    from unirl_ray.train.backend.fsdp import FSDPBackend
    from unirl_ray.rollout.trainside import TrainsideRollout
    from unirl_ray.train.stack import TrainStack

    backend = FSDPBackend(block_class_names=["JointTransformerBlock"], trainable_attr="transformer")
    with pytest.raises(ValueError, match="ema_lora_cfg"):
        TrainStack(fsdp_backend=backend, algorithm=DiffusionNFT(group_size=2))
    with pytest.raises(ValueError, match="ema_lora_cfg"):
        TrainsideRollout(backend=backend, sampling_policy="shadow")
    assert not TrainsideRollout(backend=backend).samples_with_shadow


def test_nft_steps_on_tiny_sd3_move_the_shadow_on_its_schedule():
    """8 NFT steps (8 ODE samples of 4 steps each, 2 prompts x 4): every metric finite, the EMA shadow moved once per
    step on its ramp, lagging the trained adapter once its decay is > 0. That NFT raises the reward (and a
    negated reward lowers it) is proven through the trainer: ``tests/ray/test_e2e_diffusion.py::test_nft_*``."""
    from unirl_ray.rewards.image import brightness

    _, backend, algo, stack, rollout = tiny_nft_stack()
    deviation = []
    for step in range(8):
        samples = rollout.generate(requests(step, ["a cat", "a dog"], 4), policy_version=stack.policy_version)
        rewards = brightness(images=[s.image for s in samples], prompts=[s.prompt for s in samples])
        for s, r in zip(samples, rewards):
            s.reward = r
        algo.compute_advantages(samples)
        metrics = stack.train(samples, seed=step).metrics
        assert all(math.isfinite(v) for v in metrics.values())
        deviation.append(metrics["algo/old_deviation"])
    assert backend.adapter_ema.updates == 8 and metrics["train/ema_lora_decay"] == pytest.approx(0.007)
    assert deviation[0] == 0.0 and max(deviation) > 0  # the shadow lags once the EMA decay is > 0


# ------------------------------------------------------------------------------------ recipes


def test_tiny_nft_recipe_validates_and_its_worker_trains_a_step():
    import ray

    from unirl_ray.config.recipe import load_recipe, validate_targets
    from unirl_ray.train.rank import StackWorker
    from unirl_ray.train.configs import TrainTopology
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    cfg = load_recipe(TINY_RECIPE)
    validate_targets(cfg)
    trainer = DiffusionTrainer(cfg)
    assert trainer.group_size == 4 and trainer.is_demo() and not ray.is_initialized()
    sections = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in DiffusionTrainer.worker_sections}
    worker = StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"))
    assert worker.rollout.samples_with_shadow and worker.backend.adapter_ema is not None
    light = worker.generate(requests(0, ["a cat", "a dog", "a fox", "a cow"], 4))  # the recipe's 4 x 4
    for i, s in enumerate(light):
        s.reward = float(i % 3)
    trainer.algorithm.compute_advantages(light)
    out = worker.train(light, seed=0)
    assert out["policy_version"] == 1 and out["metrics"]["train/ema_lora_decay"] == 0.0
    assert out["metrics"]["train/optimizer_steps"] == 1.0
    assert math.isfinite(out["metrics"]["train/loss"])

    without = dict(sections, backend={**sections["backend"], "ema_lora_cfg": None})
    with pytest.raises(ValueError, match="ema_lora_cfg"):
        StackWorker(without, topology=TrainTopology(), device=torch.device("cpu"))


def test_real_nft_recipe_validates_against_model_folder_configs(monkeypatch, tmp_path):
    from unirl_ray.config.recipe import RecipeError, load_recipe
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    (tmp_path / "vae").mkdir()
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [128, 256, 512, 512]}))
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"patch_size": 2}))
    monkeypatch.setenv("PRETRAINED_MODEL", str(tmp_path))
    trainer = DiffusionTrainer(load_recipe(REAL_RECIPE))
    assert not trainer.is_demo() and trainer.group_size == 24
    assert trainer.backend_cfgs["ema_lora_cfg"].rank == 32 and trainer.algorithm.kl_beta == 1e-4
    with pytest.raises(RecipeError, match="beta"):
        DiffusionTrainer(load_recipe(REAL_RECIPE, ["algorithm.beta=0"]))
