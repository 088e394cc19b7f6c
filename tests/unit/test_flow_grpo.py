"""Flow-GRPO: hand-computed loss / metrics on a fake pipeline, KL, timestep subsets, real tiny SD3."""

import copy
import math
from contextlib import nullcontext

import pytest
import torch

from unirl_ray.algorithms import FlowGRPO, LossContext
from unirl_ray.core.sample import DiffusionPart, Sample


class Shift(torch.nn.Module):
    """A 'policy' whose only parameter shifts every log-prob and every mean."""

    def __init__(self, value: float = 0.0):
        super().__init__()
        self.delta = torch.nn.Parameter(torch.tensor(value))


class FakePipeline:
    """logp[b] = cur[b, j] + module.delta; mean[b] = delta (3 elements); std[b] given."""

    def __init__(self, cur: torch.Tensor, std: torch.Tensor):
        self.cur, self.std = cur, std

    def collate(self, parts):
        return {"row": torch.stack([p.cond["row"] for p in parts])}

    def step_log_prob(self, module, batch, step_index):
        rows = batch["row"]
        logp = self.cur[rows, step_index] + module.delta
        mean = module.delta * torch.ones(len(rows), 3)
        return logp, mean, self.std[rows]


def make_samples(num_steps: int, advantages: list[float], groups: list[str] | None = None) -> list[Sample]:
    out = []
    for i, adv in enumerate(advantages):
        part = DiffusionPart(
            latents=torch.zeros(num_steps + 1, 1),
            log_probs=torch.zeros(num_steps),
            sigmas=torch.linspace(1, 0, num_steps + 1),
            cond={"row": torch.tensor(i)},
        )
        group = groups[i] if groups else "g"
        out.append(Sample(sample_id=f"s0-{i}", group_id=group, prompt="p", parts=[part], advantage=adv))
    return out


def ctx_for(policy, *, first_pass=True, reference=None, loss_scale=1.0):
    ref = None if reference is None else (lambda: nullcontext(reference))
    return LossContext(policy=policy, reference=ref, loss_scale=loss_scale, first_pass=first_pass)


def test_clipped_loss_hand_computed():
    # sample 0: A = 2, ratio 1.05 (inside the clip range 0.2): -2 * 1.05 = -2.1, with gradient
    # sample 1: A = -1, ratio 0.5 (clipped to 0.8): max(0.5, 0.8) = 0.8, no gradient
    pipe = FakePipeline(torch.tensor([[math.log(1.05)], [math.log(0.5)]]), torch.ones(2))
    algo = FlowGRPO(group_size=2, clip_range=0.2, pipeline=pipe)
    samples = make_samples(1, [2.0, -1.0])
    policy = Shift()
    m = algo.compute_loss_and_backward(samples, algo.prepare_segment(samples, seed=0), ctx_for(policy, loss_scale=0.5))
    assert m["count"] == 2
    assert m["policy_loss"] == pytest.approx(-2.1 + 0.8, abs=1e-6)
    assert m["loss"] == pytest.approx(-1.3, abs=1e-6)
    assert m["clip_frac"] == 1.0
    assert m["ratio"] == pytest.approx(1.55, abs=1e-6)
    assert m["approx_kl"] == pytest.approx(0.5 * (math.log(1.05) ** 2 + math.log(0.5) ** 2), abs=1e-6)
    assert m["kl"] == 0.0
    assert m["logp_gap"] == pytest.approx(abs(math.log(1.05)) + abs(math.log(0.5)), abs=1e-6)
    assert m["logp_gap_count"] == 2
    # d/d delta of 0.5 * mean([-2 * 1.05 * exp(delta), const]) = 0.5 * (-2.1) / 2
    assert policy.delta.grad.item() == pytest.approx(-0.525, abs=1e-6)


def test_advantage_is_clamped_and_slots_are_averaged():
    pipe = FakePipeline(torch.zeros(1, 3), torch.ones(1))
    algo = FlowGRPO(group_size=2, adv_clip_max=5.0, pipeline=pipe)
    samples = make_samples(3, [10.0])
    policy = Shift()
    m = algo.compute_loss_and_backward(samples, algo.prepare_segment(samples, seed=0), ctx_for(policy))
    assert m["count"] == 3  # 1 sample x 3 steps
    assert m["policy_loss"] / m["count"] == pytest.approx(-5.0)
    assert m["ratio"] / m["count"] == pytest.approx(1.0)
    assert m["clip_frac"] == 0.0
    # each of the 3 slots contributes -5 * ratio / 3 -> total gradient -5
    assert policy.delta.grad.item() == pytest.approx(-5.0)


def test_kl_term_hand_computed():
    pipe = FakePipeline(torch.zeros(2, 1), torch.tensor([0.5, 2.0]))
    algo = FlowGRPO(group_size=2, kl_beta=0.1, pipeline=pipe)
    assert algo.needs_reference
    samples = make_samples(1, [0.0, 0.0])
    policy, reference = Shift(0.3), Shift(0.0)
    m = algo.compute_loss_and_backward(
        samples, algo.prepare_segment(samples, seed=0), ctx_for(policy, reference=reference, first_pass=False)
    )
    # kl = 0.3^2 / (2 std^2) = [0.18, 0.01125]
    assert m["kl"] == pytest.approx(0.18 + 0.01125, abs=1e-6)
    assert m["loss"] == pytest.approx(0.1 * (0.18 + 0.01125), abs=1e-6)
    assert m["logp_gap"] == 0.0 and m["logp_gap_count"] == 0.0
    # d/d delta of 0.1 * mean(delta^2 / (2 std^2)) = 0.1 * mean(0.3 / std^2) = 0.1 * (1.2 + 0.075) / 2
    assert policy.delta.grad.item() == pytest.approx(0.06375, abs=1e-6)
    assert reference.delta.grad is None
    with pytest.raises(ValueError, match="reference"):
        algo.compute_loss_and_backward(samples, algo.prepare_segment(samples, seed=0), ctx_for(policy))


def test_timestep_fraction_subset_size_and_determinism():
    algo = FlowGRPO(group_size=2, timestep_fraction=0.3)
    samples = make_samples(10, [0.0] * 6)
    seg = algo.prepare_segment(samples, seed=7)
    chosen = seg["timesteps"]
    for s in samples:
        idx = chosen[s.sample_id]
        assert idx.shape == (3,) and len(set(idx.tolist())) == 3
        assert idx.tolist() == sorted(idx.tolist()) and 0 <= idx.min() and idx.max() < 10
        assert torch.equal(seg["old_log_probs"][s.sample_id], s.parts[0].log_probs)
    again = algo.prepare_segment(list(reversed(samples[2:])), seed=7)["timesteps"]
    assert all(torch.equal(again[k], chosen[k]) for k in again)  # independent of shard composition
    other = algo.prepare_segment(samples, seed=8)["timesteps"]
    assert any(not torch.equal(other[k], chosen[k]) for k in chosen)
    full = FlowGRPO(group_size=2).prepare_segment(samples, seed=7)["timesteps"]
    assert full["s0-0"].tolist() == list(range(10))
    assert FlowGRPO(group_size=2, timestep_fraction=0.01).num_train_steps(10) == 1


def test_config_errors_and_advantages():
    with pytest.raises(ValueError, match="group_size"):
        FlowGRPO(group_size=1)
    with pytest.raises(ValueError, match="timestep_fraction"):
        FlowGRPO(group_size=2, timestep_fraction=0.0)
    with pytest.raises(ValueError, match="kl_beta"):
        FlowGRPO(group_size=2, kl_beta=-1.0)
    assert FlowGRPO.supports_multi_update and not FlowGRPO(group_size=2).needs_reference
    algo = FlowGRPO(group_size=2, normalize_std=False)
    samples = make_samples(1, [None] * 4, groups=["a", "a", "b", "b"])
    for s, r in zip(samples, [1.0, 3.0, 5.0, None]):
        s.reward = r
    metrics = algo.compute_advantages(samples)
    assert [s.advantage for s in samples] == [-1.0, 1.0, 0.0, 0.0]
    assert metrics["algo/invalid_reward_frac"] == 0.25
    no_adv = make_samples(1, [None])
    algo.pipeline = FakePipeline(torch.zeros(1, 1), torch.ones(1))
    with pytest.raises(ValueError, match="compute_advantages"):
        algo.compute_loss_and_backward(no_adv, algo.prepare_segment(no_adv, seed=0), ctx_for(Shift()))


def test_real_tiny_sd3_first_update_ratio_one_then_moves():
    from unirl_ray.models.sd3 import SD3Bundle, SD3Pipeline, SD3PipelineConfig

    bundle = SD3Bundle.from_config(SD3PipelineConfig())
    pipe = SD3Pipeline(bundle, num_inference_steps=2, height=32, width=32)
    policy = bundle.transformer
    reference = copy.deepcopy(policy).requires_grad_(False)
    algo = FlowGRPO(group_size=2, kl_beta=0.01, timestep_fraction=0.5, pipeline=pipe)
    samples = []
    for i, (part, image) in enumerate(pipe.sample(["a", "a", "b", "b"], [0, 1, 2, 3])):
        s = Sample(sample_id=f"s0-{i}", group_id=f"g{i // 2}", prompt="ab"[i // 2], parts=[part], image=image)
        s.reward = float(image.mean()) / 255.0
        samples.append(s)
    algo.compute_advantages(samples)
    seg = algo.prepare_segment(samples, seed=0)
    assert seg["timesteps"]["s0-0"].shape == (1,)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    m = algo.compute_loss_and_backward(samples, seg, ctx_for(policy, reference=reference))
    assert m["count"] == 4
    assert m["ratio"] / m["count"] == pytest.approx(1.0, abs=1e-5)
    assert m["logp_gap"] / m["logp_gap_count"] < 1e-5
    assert m["clip_frac"] == 0.0 and m["kl"] == pytest.approx(0.0, abs=1e-10)
    opt.step()
    opt.zero_grad(set_to_none=True)
    m2 = algo.compute_loss_and_backward(samples, seg, ctx_for(policy, reference=reference, first_pass=False))
    assert m2["approx_kl"] / m2["count"] > 1e-8  # the update moved the log-probs
    assert m2["kl"] > 0 and m2["clip_frac"] > 0
    assert all(math.isfinite(v) for v in m2.values())


def test_only_sde_steps_are_candidates_for_training():
    """ODE steps (recorded log-prob NaN, outside an SDE window) are never trained."""
    samples = make_samples(6, [0.0] * 4)
    windows = [(1, 3), (2, 4), (0, 2), (4, 6)]
    for s, (lo, hi) in zip(samples, windows):
        s.parts[0].log_probs[:lo] = math.nan
        s.parts[0].log_probs[hi:] = math.nan
    seg = FlowGRPO(group_size=2).prepare_segment(samples, seed=0)
    for s, (lo, hi) in zip(samples, windows):
        assert seg["timesteps"][s.sample_id].tolist() == list(range(lo, hi))
    half = FlowGRPO(group_size=2, timestep_fraction=0.5).prepare_segment(samples, seed=0)["timesteps"]
    for s, (lo, hi) in zip(samples, windows):
        (j,) = half[s.sample_id].tolist()
        assert lo <= j < hi
    ode = make_samples(3, [0.0])
    ode[0].parts[0].log_probs[:] = math.nan
    with pytest.raises(ValueError, match="sde_window_size"):
        FlowGRPO(group_size=2).prepare_segment(ode, seed=0)
    samples[0].parts[0].log_probs[1] = math.nan  # one SDE step fewer than the others
    with pytest.raises(ValueError, match="same number of SDE steps"):
        FlowGRPO(group_size=2).prepare_segment(samples, seed=0)


def test_real_tiny_sd3_sde_window_with_shared_noise_keeps_ratio_one():
    from unirl_ray.models.sd3 import SD3Bundle, SD3Pipeline, SD3PipelineConfig

    bundle = SD3Bundle.from_config(SD3PipelineConfig())
    pipe = SD3Pipeline(bundle, num_inference_steps=4, height=32, width=32, sde_window_size=2, share_initial_noise=True)
    policy = bundle.transformer
    algo = FlowGRPO(group_size=2, clip_range=0.2, pipeline=pipe)
    groups, seeds = ["g0", "g0", "g1", "g1"], [0, 1, 2, 3]
    samples = []
    for i, (part, image) in enumerate(pipe.sample(["a", "a", "b", "b"], seeds, group_seeds=[5, 5, 6, 6])):
        s = Sample(sample_id=f"s0-{i}", group_id=groups[i], prompt="ab"[i // 2], parts=[part], image=image)
        s.reward = float(image.mean()) / 255.0
        samples.append(s)
    assert torch.equal(samples[0].parts[0].latents[0], samples[1].parts[0].latents[0])
    algo.compute_advantages(samples)
    seg = algo.prepare_segment(samples, seed=0)
    for s, mask in zip(samples, pipe.sde_steps(seeds)):
        assert seg["timesteps"][s.sample_id].tolist() == mask.nonzero().flatten().tolist()
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    m = algo.compute_loss_and_backward(samples, seg, ctx_for(policy))
    assert m["count"] == 8 and m["logp_gap"] / m["logp_gap_count"] < 1e-5
    assert m["ratio"] / m["count"] == pytest.approx(1.0, abs=1e-5)
    opt.step()
    opt.zero_grad(set_to_none=True)
    m2 = algo.compute_loss_and_backward(samples, seg, ctx_for(policy, first_pass=False))
    assert m2["approx_kl"] / m2["count"] > 1e-8 and all(math.isfinite(v) for v in m2.values())
