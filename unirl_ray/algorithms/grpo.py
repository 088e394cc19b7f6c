"""GRPO and its named variants (Dr. GRPO, DAPO, RLOO) for token-level policies (causal LMs).

One ``GRPO`` class implements the family; the variants are presets that only change defaults.
Every sample (one completion) gets one scalar advantage from the rewards of its group (the
completions drawn for the same prompt); every completion token shares it. Per token ``t``:

    ratio_t = exp(logp_t - logp_old_t)
    pg_t    = max(-A ratio_t, -A clip(ratio_t, 1 - clip_low, 1 + clip_high))
    loss_t  = pg_t + kl_beta * KL_t(policy || reference) - entropy_coef * H_t

and the per-token losses are aggregated over the completion tokens of the mini-batch as
``loss_aggregation`` says. ``logp_old`` are the behaviour log-probs recorded while sampling (pi_old
is frozen in ``prepare_segment``).

How each departs from the textbook:

- ``GRPO`` (DeepSeekMath, Shao et al. 2024): ``A = (r - mean_g) / (std_g + eps)``; token mean per
  sequence, then mean over sequences (``seq_mean_token_mean``); symmetric clip 0.2. The paper adds
  a KL penalty (beta 0.04, k3 estimator) to the loss; the default here is ``kl_beta=0`` as in
  Dr. GRPO, DAPO and most recent recipes (set ``kl_beta`` / ``kl_estimator`` to restore it).
- ``DrGRPO`` (Liu et al. 2025, "Understanding R1-Zero-like training"): removes both length and
  difficulty biases: no std division (``A = r - mean_g``) and the per-sequence token *sum* divided
  by a constant (``loss_norm_tokens``, default the pipeline's ``max_new_tokens``) instead of the
  sequence length, so long wrong answers are not penalised less per token.
- ``DAPO`` (Yu et al. 2025): asymmetric "clip-higher" (0.2 / 0.28) so low-probability tokens can
  grow; token-level aggregation over the whole global mini-batch (``token_mean``: every token
  weighs the same, however long its sequence); dynamic sampling: groups whose rewards are all equal
  carry no signal, they get advantage 0 and ``algo/filtered_group_frac`` reports them. DAPO proper
  drops them and samples more prompts until the batch is full; this class only marks them (a
  trainer may drop them with ``GRPO.filter_uninformative``; otherwise their tokens still count in
  the token-mean denominator and dilute the gradient). DAPO's overlong reward shaping is a reward,
  not part of this loss.
- ``RLOO`` (Ahmadian et al. 2024): leave-one-out baseline ``A_i = r_i - mean_{j != i} r_j =
  G/(G-1) (r_i - mean_g)``, no std division; here it keeps the PPO clip (one update per batch
  makes ratio 1 and the clip inactive, which is REINFORCE with the RLOO baseline).

Loss scaling across micro-batches and ranks (FSDP averages gradients over ranks): every
aggregation is a sum over this micro-batch times ``ctx.world_size / ctx.global_units``, where
``global_units`` (``loss_units``) counts the mini-batch's units over all ranks: valid completion
tokens for ``token_mean``, sequences for ``seq_mean_token_mean`` (sum of per-sequence token means)
and ``seq_mean_token_sum_norm`` (sum of per-sequence token sums / the constant). The gradient is then
that of the mean over the whole global mini-batch, however it is spread over ranks and micro-batches.

Multi-turn rows (an agent's trajectory: the turns chained into one sequence, ``core.sample.chain_turns``)
train their sampled tokens only (observation tokens have loss mask 0), and in the per-sequence
aggregations each turn counts as a sequence, so one chained row trains exactly as its turns would
one by one; Dr. GRPO's constant is then the per-turn budget (``max_new_tokens``). A turn trains on
its own Part's advantage where credit assignment set one (per-turn credit), else the trajectory's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter, defaultdict
from typing import Any, ClassVar, Literal

import torch

from unirl_ray.algorithms.advantages import check_finite_advantages, group_advantages, scaled_group_stats
from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.algorithms.off_policy import OffPolicyCorrection, correction_stats
from unirl_ray.config.checks import check_choice, check_literal_args
from unirl_ray.core.sample import Sample, TextPart, chain_turns, part_advantage, routed_part, routed_parts

logger = logging.getLogger(__name__)

AdvantageEstimator = Literal["grpo", "rloo"]
LossAggregation = Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]


# ---------------------------------------------------------------------------------------------------------------------
# advantage estimators (driver side, plain floats)


def _is_valid(r: float | None) -> bool:
    return r is not None and math.isfinite(r)


def _group_members(group_ids: list[str]) -> dict[str, list[int]]:
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    return members


def grpo_advantages(
    rewards: list[float | None], group_ids: list[str], *, normalize_std: bool = True, eps: float = 1e-4
) -> list[float]:
    """GRPO outcome advantages: ``(r_i - mean_g) / (std_g + eps)``, or ``r_i - mean_g`` without std.

    ``mean_g`` / ``std_g`` (population, ddof 0) are over the valid rewards of sample ``i``'s group.
    Invalid rewards (``None`` / non-finite) get 0 and do not enter the statistics; a group with
    fewer than 2 valid rewards, or all of them equal, gets 0 everywhere.
    """
    advantages, _ = group_advantages(rewards, group_ids, normalize_std=normalize_std, eps=eps)
    return advantages


def rloo_advantages(
    rewards: list[float | None], group_ids: list[str], *, normalize_std: bool = False, eps: float = 1e-4
) -> list[float]:
    """REINFORCE leave-one-out advantages: ``r_i - mean_{j != i} r_j`` over the valid rewards of the group.

    Equal to ``n/(n-1) (r_i - mean_g)`` for ``n`` valid rewards; with ``normalize_std`` it is further
    divided by ``std_g + eps`` (population std). Invalid rewards get 0; groups with fewer than 2
    valid rewards, or all equal, get 0 everywhere.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"got {len(rewards)} rewards but {len(group_ids)} group ids; pass one group id per reward")
    adv = [0.0] * len(rewards)
    for idx in _group_members(group_ids).values():
        valid = [i for i in idx if _is_valid(rewards[i])]
        values = [float(rewards[i]) for i in valid]  # type: ignore[arg-type]
        n = len(values)
        if n < 2 or max(values) == min(values):
            continue
        # on u = v / s (see scaled_group_stats): r_i - mean_{j != i} r_j == n/(n-1) (r_i - mean) == s n/(n-1) (u_i - mean_u)
        s, u, mean, std = scaled_group_stats(values)
        for i, x in zip(valid, u):
            loo = (x - mean) * n / (n - 1)
            adv[i] = loo / (std + eps / s) if normalize_std else loo * s
    check_finite_advantages(adv, rewards, "RLOO")
    return adv


def uninformative_groups(rewards: list[float | None], group_ids: list[str]) -> set[str]:
    """Groups with no learning signal: fewer than 2 valid rewards, or all valid rewards equal."""
    out = set()
    for g, idx in _group_members(group_ids).items():
        values = [float(rewards[i]) for i in idx if _is_valid(rewards[i])]  # type: ignore[arg-type]
        if len(values) < 2 or max(values) == min(values):
            out.add(g)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# token-level pieces (train side, tensors [B, T] with a float mask [B, T])


def clipped_policy_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, *, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token and the ratio: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.

    ``log_ratio``: [B, T] ``logp - logp_old``; ``advantages``: [B] (broadcast over tokens) or [B, T] (per token:
    the turns of a multi-turn row with their own advantages).
    """
    ratio = torch.exp(log_ratio)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(-adv * ratio, -adv * clipped), ratio


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1 / k2 / k3).

    With ``log_r = ref_logp - logp``: k1 = ``-log_r`` (unbiased, can be negative), k2 = ``log_r^2 / 2``
    (biased, low variance), k3 = ``exp(log_r) - 1 - log_r`` (unbiased, >= 0; the GRPO paper's choice).
    ``log_r`` is clamped to [-20, 20] in k3 so that one very unlikely reference token cannot overflow.
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        return torch.exp(log_r) - 1 - log_r
    check_choice("kl_estimator", estimator, KLEstimator)
    raise AssertionError(f"kl_estimator {estimator!r} has no formula")


def segment_sums(values: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, segment) sums of ``values * mask`` and of ``mask`` ([B, T] each; ``segments`` [B, T] long, -1
    outside every segment), as two [S] tensors over the S segments present, row by row in segment order."""
    width = int(segments.max().item()) + 1 if segments.numel() else 0
    if width <= 0:
        return values.new_zeros(0), mask.new_zeros(0)
    rows = torch.arange(segments.shape[0], device=segments.device)[:, None].expand_as(segments)
    inside = segments >= 0
    index = (rows * width + segments)[inside]
    total = values.new_zeros(segments.shape[0] * width).index_add(0, index, (values * mask)[inside])
    count = mask.new_zeros(segments.shape[0] * width).index_add(0, index, mask[inside])
    present = torch.zeros(segments.shape[0] * width, dtype=torch.bool, device=segments.device)
    present[index] = True
    return total[present], count[present]


def token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over all masked tokens of the micro-batch -- DAPO (normalised by the global token count)."""
    return (values * mask).sum()


# ---------------------------------------------------------------------------------------------------------------------


def text_part(sample: Sample, stage: str | None = None) -> TextPart:
    """The text segment of ``sample`` that ``stage`` trains (``core.sample.routed_part``)."""
    return routed_part(sample, TextPart, stage)


def _num_turns(sample: Sample, stage: str | None) -> int:
    """Turns of ``sample`` trained by ``stage``: each counts as one sequence in the per-sequence aggregations."""
    return max(1, len(routed_parts(sample, TextPart, stage)))


def _valid_tokens(part: TextPart) -> float:
    if part.loss_mask is not None:
        return float(part.loss_mask.float().sum())
    return float(len(part.completion_ids)) if part.completion_ids is not None else 0.0


class GRPO(StageAlgorithm):
    """GRPO-family stage algorithm for token sequences (see the module docstring for the math).

    Metrics returned by ``compute_loss_and_backward`` are sums; ``count`` is the number of valid
    completion tokens, so the stack reports per-token means of: ``kl`` (KL to the reference, 0
    without one), ``entropy``, ``clip_frac`` (tokens with the ratio outside
    ``[1 - clip_low, 1 + clip_high]``), ``approx_kl`` (``0.5 (logp - logp_old)^2``), ``ratio`` and
    ``logp_gap`` (``|logp - logp_old|`` on the first pass only, with ``logp_gap_count``: the
    rollout / train mismatch). ``loss`` and ``policy_loss`` come with ``loss_count`` /
    ``policy_loss_count`` so that the reported value is the objective in the configured
    aggregation (per sequence or per token).
    """

    supports_multi_update: ClassVar[bool] = True
    part_type: ClassVar[type[TextPart]] = TextPart

    def __init__(
        self,
        *,
        group_size: int,
        advantage_estimator: AdvantageEstimator = "grpo",
        normalize_std: bool = True,
        loss_aggregation: LossAggregation = "seq_mean_token_mean",
        loss_norm_tokens: int | None = None,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        dynamic_sampling: bool = False,
        kl_beta: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        entropy_coef: float = 0.0,
        off_policy: OffPolicyCorrection | dict[str, Any] | str | None = None,
        pipeline: Any = None,
    ) -> None:
        super().__init__(pipeline=pipeline)
        self.off_policy = OffPolicyCorrection.of(off_policy)
        if not isinstance(group_size, int) or group_size < 2:
            raise ValueError(f"group_size must be an int >= 2 (group-relative advantages), got {group_size!r}")
        check_literal_args(GRPO.__init__, type(self).__name__, locals())
        if loss_norm_tokens is not None and loss_norm_tokens < 1:
            raise ValueError(f"loss_norm_tokens must be >= 1 (or None: the pipeline's max_new_tokens), got {loss_norm_tokens}")
        if not (0 < clip_low < 1 and clip_high > 0):
            raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0, got clip_low={clip_low}, clip_high={clip_high}")
        if kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0 (0 disables the KL term), got {kl_beta}")
        if loss_norm_tokens is not None and loss_aggregation != "seq_mean_token_sum_norm":
            logger.warning("GRPO: loss_norm_tokens is only used by loss_aggregation='seq_mean_token_sum_norm'; ignored")
        self.group_size = group_size
        self.advantage_estimator = advantage_estimator
        self.normalize_std = normalize_std
        self.loss_aggregation = loss_aggregation
        self.loss_norm_tokens = loss_norm_tokens
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dynamic_sampling = dynamic_sampling
        self.kl_beta = kl_beta
        self.kl_estimator = kl_estimator
        self.entropy_coef = entropy_coef

    @property
    def needs_reference(self) -> bool:
        return self.kl_beta > 0

    def part_of(self, sample: Sample) -> TextPart:
        """The text this algorithm trains in ``sample``: its one TextPart, or the turns of a multi-turn trajectory
        chained into one sequence (``chain_turns``: observation tokens masked, each turn a segment)."""
        turns = routed_parts(sample, TextPart, self.stage)
        if len(turns) > 1:
            return chain_turns(sample, turns)  # type: ignore[arg-type]
        return routed_part(sample, TextPart, self.stage)  # type: ignore[return-value]

    def token_advantages(self, samples: list[Sample], segments: torch.Tensor) -> torch.Tensor:
        """[B, T] the advantage of each token's turn (``segments`` [B, T] from ``collate``; 0 outside turns):
        every turn trains on its own Part's advantage where credit assignment set one, else the sample's."""
        out = torch.zeros(segments.shape, dtype=torch.float32)
        for b, s in enumerate(samples):
            turns = routed_parts(s, TextPart, self.stage) or [self.part_of(s)]
            values = torch.tensor([part_advantage(s, t) for t in turns], dtype=torch.float32)
            row = segments[b]
            inside = row >= 0
            if int(row.max().item()) >= len(values):
                raise ValueError(f"sample {s.sample_id!r} has {len(values)} turns but its tokens name turn {int(row.max())}")
            out[b, inside] = values[row[inside]]
        return out

    @property
    def needs_proximal(self) -> bool:
        return self.off_policy.decoupled

    # ------------------------------------------------------------------ driver side
    def compute_advantages(self, samples: list[Sample]) -> dict[str, float]:
        """Group advantages by ``sample.group_id`` from ``sample.reward`` (set in place); ``algo/`` metrics.

        Invalid rewards (``None`` / non-finite) get advantage 0 (``algo/invalid_reward_frac``).
        With ``dynamic_sampling`` also reports ``algo/filtered_group_frac``: the groups with no
        signal, whose samples all have advantage 0 (see ``filter_uninformative``).
        """
        sizes = Counter(s.group_id for s in samples)
        bad = sum(1 for n in sizes.values() if n != self.group_size)
        if bad:
            logger.warning("GRPO: %d of %d groups do not have group_size=%d members", bad, len(sizes), self.group_size)
        rewards = [s.reward for s in samples]
        groups = [s.group_id for s in samples]
        if self.advantage_estimator == "grpo":
            advs = grpo_advantages(rewards, groups, normalize_std=self.normalize_std)
        else:
            advs = rloo_advantages(rewards, groups, normalize_std=self.normalize_std)
        for s, a in zip(samples, advs):
            s.advantage = a
        n = max(len(samples), 1)
        mean = sum(advs) / n
        no_signal = uninformative_groups(rewards, groups)
        metrics = {
            "algo/adv_mean": mean,
            "algo/adv_std": math.sqrt(sum((a - mean) ** 2 for a in advs) / n),
            "algo/adv_abs_max": max((abs(a) for a in advs), default=0.0),
            "algo/zero_std_group_frac": len(no_signal) / max(len(sizes), 1),
            "algo/invalid_reward_frac": sum(not _is_valid(r) for r in rewards) / n,
        }
        if self.dynamic_sampling:
            metrics["algo/filtered_group_frac"] = metrics["algo/zero_std_group_frac"]
        return metrics

    def filter_uninformative(self, samples: list[Sample]) -> list[Sample]:
        """The samples whose group has a learning signal (DAPO's dynamic-sampling filter), in order."""
        drop = uninformative_groups([s.reward for s in samples], [s.group_id for s in samples])
        return [s for s in samples if s.group_id not in drop]

    # ------------------------------------------------------------------ train side
    def loss_units(self, samples: list[Sample]) -> float:
        """Valid completion tokens for ``token_mean`` (global token normalisation); samples otherwise."""
        if self.loss_aggregation == "token_mean":
            return sum(_valid_tokens(self.part_of(s)) for s in samples)
        return float(sum(_num_turns(s, self.stage) for s in samples))  # a multi-turn row counts each turn

    def prepare_segment(self, samples: list[Sample], *, seed: int) -> dict[str, Any]:
        """Freeze pi_old: ``{"old_log_probs": {sample_id: Tensor[C]}}`` (the recorded behaviour log-probs)."""
        old = {}
        for s in samples:
            part = self.part_of(s)
            if part.log_probs is None:
                raise ValueError(f"sample {s.sample_id!r} has a light TextPart (no log_probs); train on full samples")
            old[s.sample_id] = part.log_probs.detach().float().clone()
        return {"old_log_probs": old}

    def proximal_log_probs(self, samples: list[Sample], segment: dict[str, Any], policy: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``{sample_id: Tensor[C]}``: the completion tokens' log-probs under ``policy`` as it is now (no grad)."""
        parts = [self.part_of(s) for s in samples]
        batch = self.pipeline.collate(parts)
        with torch.no_grad():
            logp, _ = self.pipeline.token_log_probs(policy, batch)
        logp = logp.detach().float().cpu()
        out = {}
        for b, (s, p) in enumerate(zip(samples, parts)):
            start = len(p.prompt_ids) - 1
            out[s.sample_id] = logp[b, start : start + len(p.completion_ids)].clone()
        return out

    def _norm_tokens(self) -> float:
        if self.loss_norm_tokens is not None:
            return float(self.loss_norm_tokens)
        limit = getattr(self.pipeline, "max_new_tokens", None)
        if limit is None:
            raise ValueError("seq_mean_token_sum_norm needs loss_norm_tokens or a pipeline with max_new_tokens")
        return float(limit)

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor, ctx: LossContext,
                   segments: torch.Tensor | None = None) -> tuple[torch.Tensor, float, float]:
        """(scaled loss to backward, metric sum, metric count) of per-token values under ``loss_aggregation``.

        The per-sequence aggregations take each turn of a row as a sequence (``segments`` from ``collate``; a
        row without them is one sequence): its token mean (or token sum / ``loss_norm_tokens``, Dr. GRPO's
        constant: the per-turn budget ``max_new_tokens`` by default), summed over the micro-batch and
        normalised by the sequences of the whole mini-batch over all ranks (``loss_units``), so that sequences
        weigh the same however they are spread over micro-batches and ranks."""
        if self.loss_aggregation == "token_mean":
            total = token_sum(per_token, mask)
            denom = ctx.global_units if ctx.global_units > 0 else 1.0  # 0 only when no token counts (sum is 0)
            return total * (ctx.world_size / denom), total.item(), mask.sum().item()
        if segments is None:  # one sequence per row
            segments = torch.where(mask > 0, 0, -1).long()
            segments[:, 0] = 0  # a row without a valid token still counts as one (empty) sequence
        sums, counts = segment_sums(per_token, mask, segments.to(per_token.device))
        per_seq = sums / (counts.clamp_min(1.0) if self.loss_aggregation == "seq_mean_token_mean" else self._norm_tokens())
        denom = ctx.global_units if ctx.global_units > 0 else 1.0  # sequences of the mini-batch over all ranks
        total = per_seq.sum()
        return total * (ctx.world_size / denom), total.item(), float(per_seq.numel())

    def compute_loss_and_backward(
        self, samples: list[Sample], segment: dict[str, Any], ctx: LossContext
    ) -> dict[str, float]:
        """Clipped-surrogate (+ KL - entropy) loss of a micro-batch; one ``backward``; metric sums."""
        if self.pipeline is None:
            raise ValueError("GRPO needs pipeline=<CausalLMPipeline-like> to recompute token log-probs")
        if self.needs_reference and ctx.reference is None:
            raise ValueError("kl_beta > 0 needs a reference model; the stack must pass ctx.reference")
        try:
            parts = [dataclasses.replace(self.part_of(s), log_probs=segment["old_log_probs"][s.sample_id]) for s in samples]
        except KeyError as err:
            raise ValueError(f"sample {err} is not in this segment; call prepare_segment on its shard first") from err
        batch = self.pipeline.collate(parts)
        logp, entropy = self.pipeline.token_log_probs(ctx.policy, batch)
        mask = batch["completion_mask"].to(logp.device)
        old = batch["old_log_probs"].to(logp.device)
        segments = batch.get("segment_ids")  # only when the micro-batch holds a multi-turn row
        if segments is None:
            adv = self.advantages(samples).to(logp.device)
        else:
            adv = self.token_advantages(samples, segments).to(logp.device)

        anchor, is_stats = old, {}
        if self.off_policy.decoupled:  # clip around the proximal policy, weight by pi_prox / pi_behav
            try:
                prox_parts = [dataclasses.replace(p, log_probs=segment["proximal_log_probs"][s.sample_id])
                              for p, s in zip(parts, samples)]
            except KeyError as err:
                raise ValueError(f"no proximal log-probs for sample {err}: off_policy.mode=decoupled needs the "
                                 "TrainStack to compute them (needs_proximal)") from err
            anchor = self.pipeline.collate(prox_parts)["old_log_probs"].to(logp.device)
        log_ratio = (logp - anchor) * mask  # masked before exp: positions outside completions hold garbage
        pg, ratio = clipped_policy_loss(log_ratio, adv, clip_low=self.clip_low, clip_high=self.clip_high)
        if self.off_policy.decoupled:
            used, raw, capped = self.off_policy.weights(anchor * mask, old * mask)
            pg = pg * used
            is_stats = correction_stats(raw, capped, (anchor - old) * mask, mask)
        kl = torch.zeros_like(pg)
        if self.kl_beta > 0:
            with ctx.reference() as ref, torch.no_grad():
                ref_logp, _ = self.pipeline.token_log_probs(ref, batch)
            kl = kl_penalty(logp, ref_logp.to(logp.device).detach(), self.kl_estimator)
        per_token = pg
        if self.kl_beta > 0:
            per_token = per_token + self.kl_beta * kl
        if self.entropy_coef != 0:
            per_token = per_token - self.entropy_coef * entropy
        scaled, loss_sum, agg_count = self._aggregate(per_token, mask, ctx, segments)
        scaled.backward()

        with torch.no_grad():
            _, pg_sum, _ = self._aggregate(pg, mask, ctx, segments)
            lr = log_ratio.detach()
            outside = (ratio < 1 - self.clip_low) | (ratio > 1 + self.clip_high)
            n_tokens = mask.sum().item()
            out = {
                "loss": loss_sum,
                "loss_count": agg_count,
                "policy_loss": pg_sum,
                "policy_loss_count": agg_count,
                "kl": (kl * mask).sum().item(),
                "entropy": (entropy.detach() * mask).sum().item(),
                "clip_frac": (outside.float() * mask).sum().item(),
                "approx_kl": (0.5 * lr**2 * mask).sum().item(),
                "ratio": (ratio.detach() * mask).sum().item(),
                "count": n_tokens,
                "logp_gap": (((logp.detach() - old) * mask).abs()).sum().item() if ctx.first_pass else 0.0,
                "logp_gap_count": n_tokens if ctx.first_pass else 0.0,
                **is_stats,
            }
        return out


class DrGRPO(GRPO):
    """Dr. GRPO: no std normalisation, per-sequence token sum / constant (see the module docstring)."""

    def __init__(
        self,
        *,
        group_size: int,
        normalize_std: bool = False,
        loss_aggregation: LossAggregation = "seq_mean_token_sum_norm",
        **kwargs: Any,
    ) -> None:
        super().__init__(group_size=group_size, normalize_std=normalize_std, loss_aggregation=loss_aggregation, **kwargs)


class DAPO(GRPO):
    """DAPO: clip-higher 0.2 / 0.28, global token-mean loss, dynamic-sampling marks (see the module docstring)."""

    def __init__(
        self,
        *,
        group_size: int,
        loss_aggregation: LossAggregation = "token_mean",
        clip_low: float = 0.2,
        clip_high: float = 0.28,
        dynamic_sampling: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            group_size=group_size,
            loss_aggregation=loss_aggregation,
            clip_low=clip_low,
            clip_high=clip_high,
            dynamic_sampling=dynamic_sampling,
            **kwargs,
        )


class RLOO(GRPO):
    """RLOO: leave-one-out baseline, no std normalisation (see the module docstring)."""

    def __init__(
        self,
        *,
        group_size: int,
        advantage_estimator: AdvantageEstimator = "rloo",
        normalize_std: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            group_size=group_size, advantage_estimator=advantage_estimator, normalize_std=normalize_std, **kwargs
        )
