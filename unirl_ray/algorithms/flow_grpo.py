"""Flow-GRPO: GRPO on the per-step Gaussian transitions of a flow-matching SDE sampler.

Every denoising step ``x_j -> x_{j+1}`` of a recorded trajectory is an action with a log-prob under
the policy (see ``unirl_ray.models.sd3.pipeline``). All steps of a sample share its group-relative
advantage ``A``. Per trained step the loss is the PPO clipped surrogate

    ratio = exp(logp - logp_old)
    loss  = mean_b max(-A_b * ratio_b, -A_b * clip(ratio_b, 1 - eps, 1 + eps))
          + kl_beta * mean_b mean_elements (mean_b - mean_ref_b)^2 / (2 std_b^2)

where the KL term is the exact KL between the policy's and the reference's Gaussian transitions
(same std, different means). ``A`` is clamped to ``[-adv_clip_max, adv_clip_max]``; ``eps`` is
``clip_range``. ``logp_old`` are the behaviour log-probs recorded while sampling (pi_old is frozen in
``prepare_segment``); with train-side on-policy sampling they are exact, so the first update has
ratio 1 up to float rounding.

Variants are options, not forks:

- Flow-GRPO-Fast / MixGRPO: ``pipeline.sde_window_size`` makes only a window of steps stochastic;
  the ODE steps outside it carry log-prob NaN and are never trained (only steps with a finite
  recorded log-prob are candidates). ``timestep_fraction`` trains a random subset of those.
- DanceGRPO's shared initial noise within a group: ``pipeline.share_initial_noise``.
- CFG on/off: ``pipeline.guidance_scale`` (1 = off); KL to the reference on/off: ``kl_beta`` (0 = off).
- Stale samples (async trainers): ``off_policy: {mode: decoupled}`` clips around the proximal policy and
  weights each step by ``pi_prox / pi_behav`` (see ``unirl_ray.algorithms.off_policy``).
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from typing import Any, ClassVar

import torch

from unirl_ray.algorithms.advantages import group_advantages
from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.algorithms.off_policy import OffPolicyCorrection, correction_stats
from unirl_ray.core.sample import DiffusionPart, Sample, routed_part

logger = logging.getLogger(__name__)


def diffusion_part(sample: Sample, stage: str | None = None) -> DiffusionPart:
    """The diffusion trajectory of ``sample`` that ``stage`` trains (``core.sample.routed_part``)."""
    return routed_part(sample, DiffusionPart, stage)


def segment_seed(seed: int, sample_id: str) -> int:
    """Stable (process-independent) seed for one sample's random choices."""
    return zlib.crc32(f"{seed}:{sample_id}".encode())


class FlowGRPO(StageAlgorithm):
    """Flow-GRPO stage algorithm (see the module docstring for the loss).

    Metrics returned by ``compute_loss_and_backward`` are sums over (sample, trained step) pairs,
    with ``count`` = number of such pairs, so that the stack reports means:

    - ``loss``: total per-pair loss (policy + ``kl_beta`` x kl);
    - ``policy_loss``: clipped surrogate ``max(-A ratio, -A clip(ratio))``;
    - ``kl``: KL(policy || reference) of the transition, per element (0 without a reference);
    - ``clip_frac``: fraction of pairs with ``|ratio - 1| > clip_range``;
    - ``approx_kl``: ``0.5 (logp - logp_old)^2`` (KL(pi_old || pi) estimate since sampling);
    - ``ratio``: mean importance ratio ``exp(logp - logp_old)``;
    - ``logp_gap``: ``|logp - logp_old|`` measured only while ``ctx.first_pass`` (params still equal
      the sampling params), averaged over ``logp_gap_count`` pairs: the rollout / train mismatch
      (numerics, batch composition, dtype, stale weights). The stack reports it as ``rollout/logp_gap``.
    """

    supports_multi_update: ClassVar[bool] = True
    part_type: ClassVar[type[DiffusionPart]] = DiffusionPart

    def __init__(
        self,
        *,
        group_size: int,
        clip_range: float = 1e-4,
        adv_clip_max: float = 5.0,
        normalize_std: bool = True,
        kl_beta: float = 0.0,
        timestep_fraction: float = 1.0,
        off_policy: OffPolicyCorrection | dict[str, Any] | str | None = None,
        pipeline: Any = None,
    ) -> None:
        """
        Args:
            group_size: Samples per prompt; advantages are relative to the group.
            clip_range: PPO clip epsilon of the importance ratio.
            adv_clip_max: Advantages are clamped to ``[-adv_clip_max, adv_clip_max]``.
            normalize_std: Divide group advantages by the group's reward std.
            kl_beta: Weight of the exact KL to the reference's Gaussian transitions (0 disables it).
            timestep_fraction: Fraction of each trajectory's SDE steps trained (a random subset, at least one).
            off_policy: Correction for samples drawn by an older policy (``unirl_ray.algorithms.off_policy``):
                ``{mode: none}`` (default) or ``{mode: decoupled, is_cap: 2.0, cap_policy: truncate}``.
        """
        super().__init__(pipeline=pipeline)
        self.off_policy = OffPolicyCorrection.of(off_policy)
        if not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"group_size must be an int >= 2 (group-relative advantages), got {group_size!r}")
        if not clip_range > 0:
            raise ValueError(f"clip_range must be > 0, got {clip_range}")
        if not adv_clip_max > 0:
            raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
        if kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0 (0 disables the KL term), got {kl_beta}")
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        self.group_size = group_size
        self.clip_range = clip_range
        self.adv_clip_max = adv_clip_max
        self.normalize_std = normalize_std
        self.kl_beta = kl_beta
        self.timestep_fraction = timestep_fraction

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    @property
    def needs_proximal(self) -> bool:
        return self.off_policy.decoupled

    def compute_advantages(self, samples: list[Sample]) -> dict[str, float]:
        """Group-relative advantages by ``sample.group_id`` from ``sample.reward`` (set in place)."""
        sizes = Counter(s.group_id for s in samples)
        bad = sum(1 for n in sizes.values() if n != self.group_size)
        if bad:
            logger.warning(
                "FlowGRPO: %d of %d groups do not have group_size=%d members", bad, len(sizes), self.group_size
            )
        advs, metrics = group_advantages(
            [s.reward for s in samples], [s.group_id for s in samples], normalize_std=self.normalize_std
        )
        for s, a in zip(samples, advs):
            s.advantage = a
        return metrics

    def num_train_steps(self, num_steps: int) -> int:
        """Trained steps per trajectory of ``num_steps`` SDE steps: ``max(1, round(T * timestep_fraction))``."""
        return max(1, min(num_steps, round(num_steps * self.timestep_fraction)))

    def prepare_segment(self, samples: list[Sample], *, seed: int) -> dict[str, Any]:
        """Pick each sample's trained step indices (sorted, from ``seed`` and its id); freeze pi_old.

        Candidates are the steps with a finite recorded log-prob (the SDE steps; ODE steps outside
        an SDE window hold NaN). Returns ``{"timesteps": {sample_id: LongTensor[K]},
        "old_log_probs": {sample_id: Tensor[T]}}``.
        """
        timesteps: dict[str, torch.Tensor] = {}
        old: dict[str, torch.Tensor] = {}
        for s in samples:
            part = self.part_of(s)
            sde_steps = torch.isfinite(part.log_probs).nonzero().flatten()
            if sde_steps.numel() == 0:
                raise ValueError(
                    f"sample {s.sample_id!r} has no SDE step to train (every recorded log-prob is NaN: ODE sampling); "
                    "Flow-GRPO needs pipeline.sde_window_size >= 1 or null"
                )
            gen = torch.Generator().manual_seed(segment_seed(seed, s.sample_id))
            pick = torch.randperm(sde_steps.numel(), generator=gen)[: self.num_train_steps(sde_steps.numel())]
            timesteps[s.sample_id] = sde_steps[pick].sort().values
            old[s.sample_id] = part.log_probs.detach().float().clone()
        counts = {int(t.numel()) for t in timesteps.values()}
        if len(counts) > 1:
            raise ValueError(
                f"samples of one shard have different numbers of trained steps {sorted(counts)}; every trajectory "
                "must have the same number of SDE steps (same num_inference_steps and sde_window_size)"
            )
        return {"timesteps": timesteps, "old_log_probs": old}

    def proximal_log_probs(self, samples: list[Sample], segment: dict[str, Any], policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{sample_id: Tensor[T]}``: log-probs of the chosen steps under ``policy`` as it is now (no grad;
        NaN at the steps not trained)."""
        idx = torch.stack([segment["timesteps"][s.sample_id] for s in samples])
        batch = self.pipeline.collate([self.part_of(s) for s in samples])
        prox = torch.full((len(samples), self.part_of(samples[0]).num_steps), float("nan"))
        rows = torch.arange(len(samples))
        with torch.no_grad():
            for k in range(idx.shape[1]):
                logp, _, _ = self.pipeline.step_log_prob(policy, batch, idx[:, k])
                prox[rows, idx[:, k]] = logp.detach().float().cpu()
        return {s.sample_id: prox[b].clone() for b, s in enumerate(samples)}

    def _advantages(self, samples: list[Sample]) -> torch.Tensor:
        """[B] clamped advantages (a part's own advantage overrides the sample's)."""
        return self.advantages(samples).clamp(-self.adv_clip_max, self.adv_clip_max)

    def compute_loss_and_backward(
        self, samples: list[Sample], segment: dict[str, Any], ctx: LossContext
    ) -> dict[str, float]:
        """Clipped-surrogate (+ KL) loss over each sample's chosen steps; one ``backward`` per step slot."""
        if self.pipeline is None:
            raise ValueError("FlowGRPO needs pipeline=<SD3Pipeline-like> to recompute step log-probs")
        if self.needs_reference and ctx.reference is None:
            raise ValueError("kl_beta > 0 needs a reference model; the stack must pass ctx.reference")
        try:
            idx = torch.stack([segment["timesteps"][s.sample_id] for s in samples])
            old = torch.stack([segment["old_log_probs"][s.sample_id] for s in samples])
            prox = torch.stack([segment["proximal_log_probs"][s.sample_id] for s in samples]) if (
                self.off_policy.decoupled) else None
        except KeyError as err:
            raise ValueError(f"sample {err} is not in this segment; call prepare_segment on its shard first") from err
        batch = self.pipeline.collate([self.part_of(s) for s in samples])
        adv = self._advantages(samples)
        rows = torch.arange(len(samples))
        sums: dict[str, float] = {}
        num_slots = idx.shape[1]
        for k in range(num_slots):
            j = idx[:, k]
            stats = self._slot_loss(ctx, batch, j, old[rows, j], adv, num_slots, None if prox is None else prox[rows, j])
            for name, value in stats.items():
                sums[name] = max(sums.get(name, value), value) if name.endswith("_max") else sums.get(name, 0.0) + value
        count = float(len(samples) * num_slots)
        sums["count"] = count
        sums["logp_gap_count"] = count if ctx.first_pass else 0.0
        if not ctx.first_pass:
            sums["logp_gap"] = 0.0
        return sums

    def _slot_loss(
        self,
        ctx: LossContext,
        batch: dict[str, torch.Tensor],
        step_index: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        num_slots: int,
        prox_logp: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Loss of one step slot (step_index, old_logp, adv, prox_logp: [B]); backward; per-pair metric sums."""
        logp, mean, std = self.pipeline.step_log_prob(ctx.policy, batch, step_index)
        old_logp, adv = old_logp.to(logp.device), adv.to(logp.device)
        anchor = old_logp if prox_logp is None else prox_logp.to(logp.device)
        log_ratio = logp - anchor
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - self.clip_range, 1 + self.clip_range)
        per_pair = torch.maximum(-adv * ratio, -adv * clipped)
        is_stats: dict[str, float] = {}
        if prox_logp is not None:  # decoupled PPO: weight by pi_prox / pi_behav (detached, capped)
            used, raw, capped = self.off_policy.weights(anchor, old_logp)
            per_pair = per_pair * used
            is_stats = correction_stats(raw, capped, anchor - old_logp)
        kl = torch.zeros_like(per_pair)
        if self.kl_beta > 0:
            with ctx.reference() as ref, torch.no_grad():
                _, ref_mean, _ = self.pipeline.step_log_prob(ref, batch, step_index)
            sq = ((mean - ref_mean.detach()) ** 2).flatten(1).mean(dim=1)
            kl = sq / (2 * std**2)
        per_pair_loss = per_pair + self.kl_beta * kl
        (per_pair_loss.mean() * ctx.loss_scale / num_slots).backward()
        log_ratio = log_ratio.detach()
        out = {
            "loss": per_pair_loss.detach().sum().item(),
            "policy_loss": per_pair.detach().sum().item(),
            "kl": kl.detach().sum().item(),
            "clip_frac": ((ratio.detach() - 1).abs() > self.clip_range).float().sum().item(),
            "approx_kl": (0.5 * log_ratio**2).sum().item(),
            "ratio": ratio.detach().sum().item(),
            **is_stats,
        }
        if ctx.first_pass:
            out["logp_gap"] = (logp.detach() - old_logp).abs().sum().item()
        return out
