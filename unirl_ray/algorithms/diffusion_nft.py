"""DiffusionNFT: online RL for flow models on the forward (noising) process.

Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process". No
log-probs and no SDE: the rollout may use any solver (the ODE here), only the clean samples ``x0``
and their rewards matter. Per sample and trained noise level ``t`` (paper notation):

    x_t   = (1 - t) x0 + t eps,  eps ~ N(0, I),   v = eps - x0          (flow-matching target)
    v+    = (1 - beta) v_old + beta v_theta                             (implicit positive policy)
    v-    = (1 + beta) v_old - beta v_theta                             (implicit negative policy)
    r     = 1/2 + 1/2 clip(A, -C, C) / C  in [0, 1]                     (optimality probability)
    L     = C / beta * [ r ||v+ - v||_w^2 + (1 - r) ||v- - v||_w^2 ] + kl_beta ||v_theta - v_ref||^2

``v_old`` is the "old" (sampling) policy: the EMA shadow adapter of ``backend.ema_lora_cfg``
(``LossContext.shadow_policy``), frozen within a step; the backend moves it towards the trained
adapter at the end of every train step. ``A`` is the reward minus its group's mean, divided by the
reward std of the whole step (``global_std``, as the reference implementation) or of the group;
``C`` = ``adv_clip_max``. ``||.||_w^2`` is the paper's adaptive loss weighting
(``adaptive_weighting``): the x0-prediction error of ``x0_hat = x_t - t v+-`` squared, averaged
over elements and divided by its own detached mean absolute value (the reference implementation's
self-normalised x0 regression); without it, the plain element mean of ``(v+- - v)^2``. Dividing
by ``beta`` keeps the gradient scale independent of ``beta`` (``v+-`` move by ``beta`` per unit of
``v_theta``); multiplying by ``C``, as the reference implementation does, makes the
advantage-dependent part ``A / (2 beta) (L+ - L-)`` independent of ``C``.

Noise levels ``t`` are the rollout schedule's ``sigmas[:T]``; each sample trains
``max(1, round(T * timestep_fraction))`` of them, picked without replacement, each with its own
noise ``eps``; both are fixed per step by the step seed (so a multi-update epoch revisits them).
With ``guidance_scale > 1`` the velocities are the CFG-guided ones (the policy that samples); the
paper trains and samples CFG-free (``guidance_scale: 1``).

Sampling with the old policy is the trainside rollout's job (``TrainsideRollout.sampling_policy``).
A dedicated engine is synced with the trained adapter, so there the samples come from the current
policy rather than the shadow; the loss is unchanged.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Any, ClassVar

import torch

from unirl_ray.algorithms.advantages import group_advantages
from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.algorithms.flow_grpo import segment_seed
from unirl_ray.core.sample import DiffusionPart, Sample

logger = logging.getLogger(__name__)

STD_EPS = 1e-4
"""Added to the reward std before dividing (as ``group_advantages``)."""
MIN_WEIGHT = 1e-5
"""Lower clamp of the adaptive weight (mean absolute x0 error), as in the reference implementation."""


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = 1/2 + 1/2 clip(A, -C, C) / C: advantages [B] -> optimality probabilities [B] in [0, 1]."""
    return 0.5 + 0.5 * advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max


def implicit_policies(v_old: torch.Tensor, v_theta: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(v+, v-) = ((1 - beta) v_old + beta v_theta, (1 + beta) v_old - beta v_theta)."""
    return (1 - beta) * v_old + beta * v_theta, (1 + beta) * v_old - beta * v_theta


def _per_sample(values: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B] mean over the non-batch axes."""
    return values.flatten(1).mean(dim=1)


def regression_loss(
    v_pred: torch.Tensor,
    v_target: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    *,
    adaptive: bool,
) -> torch.Tensor:
    """[B] flow-matching regression loss of a velocity prediction.

    ``adaptive``: ``mean((x0_hat - x0)^2) / sg(mean|x0_hat - x0|)`` with ``x0_hat = x_t - t v_pred``
    (the weight clamped below at ``MIN_WEIGHT``); else ``mean((v_pred - v_target)^2)``. Shapes:
    ``v_pred``, ``v_target``, ``x_t``, ``x0`` [B, ...]; ``t`` [B].
    """
    if not adaptive:
        return _per_sample((v_pred - v_target) ** 2)
    err = x_t - t.reshape(-1, *([1] * (x_t.dim() - 1))) * v_pred - x0
    weight = _per_sample(err.detach().abs()).clamp_min(MIN_WEIGHT)
    return _per_sample(err**2) / weight


class DiffusionNFT(StageAlgorithm):
    """DiffusionNFT stage algorithm (see the module docstring for the loss).

    Needs ``backend.ema_lora_cfg`` (the shadow adapter is the old / sampling policy; the trainside
    rollout samples with it). Metrics are sums over (sample, trained noise level) pairs with
    ``count`` = their number, so the stack reports means: ``loss``, ``policy_loss`` (the NFT term),
    ``kl`` (``||v_theta - v_ref||^2`` per element, 0 without a reference), ``pos_loss`` /
    ``neg_loss`` (``||v+- - v||_w^2``), ``optimality`` (r) and ``old_deviation``
    (``||v_theta - v_old||^2`` per element: how far the trained policy has moved from the old one).
    """

    supports_multi_update: ClassVar[bool] = True
    part_type: ClassVar[type[DiffusionPart]] = DiffusionPart
    needs_shadow_policy: ClassVar[bool] = True
    """The loss needs ``LossContext.shadow_policy`` (``backend.ema_lora_cfg``); the stack checks it."""

    def __init__(
        self,
        *,
        group_size: int,
        beta: float = 1.0,
        adv_clip_max: float = 5.0,
        normalize_std: bool = True,
        global_std: bool = True,
        adaptive_weighting: bool = True,
        timestep_fraction: float = 0.99,
        kl_beta: float = 0.0,
        pipeline: Any = None,
    ) -> None:
        """
        Args:
            group_size: Samples per prompt; advantages are relative to the group.
            beta: Strength of the implicit policies ``v+- = v_old +- beta (v_theta - v_old)`` (> 0).
            adv_clip_max: C: advantages are clipped to ``[-C, C]`` and mapped to ``r = 1/2 + A / (2C)``.
            normalize_std: Divide the advantages ``reward - mean_group`` by a reward std.
            global_std: With ``normalize_std``: the std of every valid reward of the step (the reference
                implementation's default) instead of the group's own std (GRPO).
            adaptive_weighting: Self-normalised x0-regression weighting of the paper; false: plain velocity MSE.
            timestep_fraction: Fraction of the rollout's T noise levels trained per sample (at least one).
            kl_beta: Weight of ``||v_theta - v_ref||^2`` to the reference model (0 disables it).
        """
        super().__init__(pipeline=pipeline)
        if not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"group_size must be an int >= 2 (group-relative advantages), got {group_size!r}")
        if not beta > 0:
            raise ValueError(f"beta must be > 0 (the implicit policies' step from v_old), got {beta}")
        if not adv_clip_max > 0:
            raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        if kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0 (0 disables the KL term), got {kl_beta}")
        self.group_size = group_size
        self.beta = beta
        self.adv_clip_max = adv_clip_max
        self.normalize_std = normalize_std
        self.global_std = global_std
        self.adaptive_weighting = adaptive_weighting
        self.timestep_fraction = timestep_fraction
        self.kl_beta = kl_beta

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    # ------------------------------------------------------------------ driver side
    def compute_advantages(self, samples: list[Sample]) -> dict[str, float]:
        """Group-relative advantages (set in place) and ``algo/`` metrics.

        ``A = (reward - mean_group) / (std + 1e-4)`` with the step's or the group's std (``global_std``),
        or without the division. Besides the ``group_advantages`` metrics: ``algo/optimality_mean``
        (mean r) and ``algo/adv_clipped_frac`` (samples whose ``|A| >= adv_clip_max``: r is 0 or 1).
        """
        sizes = Counter(s.group_id for s in samples)
        bad = sum(1 for n in sizes.values() if n != self.group_size)
        if bad:
            logger.warning(
                "DiffusionNFT: %d of %d groups do not have group_size=%d members", bad, len(sizes), self.group_size
            )
        rewards = [s.reward for s in samples]
        groups = [s.group_id for s in samples]
        if self.normalize_std and self.global_std:
            # on r / S (S = max |r|) nothing overflows: (r - mean_g) / (std + eps) == (u - mean_u) / (std_u + eps / S)
            valid = [float(r) for r in rewards if r is not None and math.isfinite(r)]
            scale = max((abs(r) for r in valid), default=0.0) or 1.0
            scaled = [None if r is None or not math.isfinite(r) else r / scale for r in rewards]
            advs, metrics = group_advantages(scaled, groups, normalize_std=False)  # invalid where rewards are
            u = torch.tensor([r / scale for r in valid], dtype=torch.float64)
            std = float(u.std(unbiased=False)) if u.numel() > 1 else 0.0
            adv = torch.tensor(advs, dtype=torch.float64) / (std + STD_EPS / scale)
            if len(advs):
                metrics.update({  # of the normalised advantages
                    "algo/adv_mean": float(adv.mean()),
                    "algo/adv_std": float(adv.std(unbiased=False)),
                    "algo/adv_abs_max": float(adv.abs().max()),
                })
        else:
            advs, metrics = group_advantages(rewards, groups, normalize_std=self.normalize_std)
            adv = torch.tensor(advs, dtype=torch.float64)
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
        if len(advs):
            metrics["algo/optimality_mean"] = float(optimality_probability(adv, self.adv_clip_max).mean())
            metrics["algo/adv_clipped_frac"] = float((adv.abs() >= self.adv_clip_max).double().mean())
        return metrics

    # ------------------------------------------------------------------ train side
    def num_train_steps(self, num_steps: int) -> int:
        """Noise levels trained per sample of a T-step rollout: ``max(1, round(T * timestep_fraction))``."""
        return max(1, min(num_steps, round(num_steps * self.timestep_fraction)))

    def prepare_segment(self, samples: list[Sample], *, seed: int) -> dict[str, Any]:
        """Pick each sample's noise levels (indices into its ``sigmas[:T]``, sorted) from ``seed`` and its id.

        Returns ``{"sigma_index": {sample_id: LongTensor[K]}, "seed": seed}``; the noise of pair
        ``(sample, k)`` is drawn from ``seed``, the sample id and ``k`` when the loss needs it.
        """
        chosen: dict[str, torch.Tensor] = {}
        for s in samples:
            steps = self.part_of(s).num_steps
            gen = torch.Generator().manual_seed(segment_seed(seed, s.sample_id))
            chosen[s.sample_id] = torch.randperm(steps, generator=gen)[: self.num_train_steps(steps)].sort().values
        return {"sigma_index": chosen, "seed": int(seed)}

    def _optimality(self, samples: list[Sample]) -> torch.Tensor:
        """[B] r of each sample (a part's own advantage overrides the sample's)."""
        return optimality_probability(self.advantages(samples), self.adv_clip_max)

    def compute_loss_and_backward(
        self, samples: list[Sample], segment: dict[str, Any], ctx: LossContext
    ) -> dict[str, float]:
        """NFT (+ KL) loss over each sample's chosen noise levels; one ``backward`` per level slot."""
        if self.pipeline is None:
            raise ValueError("DiffusionNFT needs pipeline=<SD3Pipeline-like> (collate, velocity)")
        if ctx.shadow_policy is None:
            raise ValueError(
                "DiffusionNFT needs the old policy: set backend.ema_lora_cfg (EmaLoraConfig), whose shadow adapter "
                "the stack passes as LossContext.shadow_policy"
            )
        if self.needs_reference and ctx.reference is None:
            raise ValueError("kl_beta > 0 needs a reference model; the stack must pass ctx.reference")
        try:
            idx = torch.stack([segment["sigma_index"][s.sample_id] for s in samples])
        except KeyError as err:
            raise ValueError(f"sample {err} is not in this segment; call prepare_segment on its shard first") from err
        batch = self.pipeline.collate([self.part_of(s) for s in samples])
        x0 = batch["latents"][:, -1].float()
        r = self._optimality(samples)
        rows = torch.arange(len(samples))
        sums: dict[str, float] = {}
        num_slots = idx.shape[1]
        for k in range(num_slots):
            t = batch["sigmas"][rows, idx[:, k]].float()
            eps = torch.stack([
                torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(
                    segment_seed(segment["seed"], f"{s.sample_id}/noise{k}")))
                for s in samples
            ])
            stats = self._slot_loss(ctx, batch, x0, eps, t, r, num_slots)
            for name, value in stats.items():
                sums[name] = sums.get(name, 0.0) + value
        sums["count"] = float(len(samples) * num_slots)
        return sums

    def _slot_loss(
        self,
        ctx: LossContext,
        batch: dict[str, torch.Tensor],
        x0: torch.Tensor,
        eps: torch.Tensor,
        t: torch.Tensor,
        r: torch.Tensor,
        num_slots: int,
    ) -> dict[str, float]:
        """Loss of one slot (x0, eps: [B, ...]; t, r: [B]); backward; per-pair metric sums."""
        t_b = t.reshape(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - t_b) * x0 + t_b * eps
        with ctx.shadow_policy() as old, torch.no_grad():
            v_old = self.pipeline.velocity(old, batch, x_t, t)
        v_theta = self.pipeline.velocity(ctx.policy, batch, x_t, t)
        device = v_theta.device
        x_t, x0, v_old, r, t = x_t.to(device), x0.to(device), v_old.detach().to(device), r.to(device), t.to(device)
        v_target = eps.to(device) - x0
        v_pos, v_neg = implicit_policies(v_old, v_theta, self.beta)
        pos = regression_loss(v_pos, v_target, x_t, x0, t, adaptive=self.adaptive_weighting)
        neg = regression_loss(v_neg, v_target, x_t, x0, t, adaptive=self.adaptive_weighting)
        policy = self.adv_clip_max / self.beta * (r * pos + (1 - r) * neg)
        kl = torch.zeros_like(policy)
        if self.kl_beta > 0:
            with ctx.reference() as ref, torch.no_grad():
                v_ref = self.pipeline.velocity(ref, batch, x_t, t)
            kl = _per_sample((v_theta - v_ref.detach().to(device)) ** 2)
        per_pair = policy + self.kl_beta * kl
        (per_pair.mean() * ctx.loss_scale / num_slots).backward()
        with torch.no_grad():
            return {
                "loss": per_pair.sum().item(),
                "policy_loss": policy.sum().item(),
                "kl": kl.sum().item(),
                "pos_loss": pos.sum().item(),
                "neg_loss": neg.sum().item(),
                "optimality": r.sum().item(),
                "old_deviation": _per_sample((v_theta - v_old) ** 2).sum().item(),
            }
