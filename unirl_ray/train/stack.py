"""``TrainStack``: loss/backward ordering of one training stage (one Part); ``UnifiedModelTrainStack``: several
stages over one backend in one optimizer step.

For each rollout shard: ``prepare_segment`` (freeze pi_old once) -> ``num_updates_per_batch``
epochs over disjoint, shuffled mini-batches -> per mini-batch, ``compute_loss_and_backward`` on
each micro-batch, then one ``optimizer_step`` -> the ``rollout_end`` EMA update of the backend
(``FSDPBackend.update_ema``) -> a ``TrainStepResult`` with metrics averaged over micro-batches and ranks.

Every rank must run the same number of forward/backward calls (FSDP2 collectives), so shards are
equal-sized and the mini-batch layout depends only on the shard size and the step seed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.distributed as dist

from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.config.checks import Bound, PositiveInt, check_literal_args
from unirl_ray.core.sample import Sample, TrainStepResult
from unirl_ray.train.backend.fsdp import FSDPBackend


GradNorm = Annotated[float, Bound(gt=0, why="null: no clipping; a negative norm would flip every gradient")]


@dataclass(kw_only=True)
class TrainStackConfig:
    """Mini-batching of one train step."""

    micro_batch_size: PositiveInt = 1
    """Samples per forward/backward on one rank (a memory knob: it does not change the math)."""
    mini_batch_size: PositiveInt | None = None
    """Samples per optimizer step over ALL ranks (each rank takes ``mini_batch_size / world_size``);
    None: the whole step's batch, one optimizer step per epoch. Global, so the same recipe does the
    same math on any number of workers."""
    num_updates_per_batch: PositiveInt = 1
    """Epochs over the shard (PPO); > 1 needs ``StageAlgorithm.supports_multi_update``."""
    max_grad_norm: GradNorm | None = 1.0
    """Gradient clipping threshold, > 0 (None: no clipping)."""


class TrainStack:
    """Single-stage train stack over one ``FSDPBackend`` and one ``StageAlgorithm``."""

    def __init__(
        self,
        *,
        micro_batch_size: PositiveInt = 1,
        mini_batch_size: PositiveInt | None = None,
        num_updates_per_batch: PositiveInt = 1,
        max_grad_norm: GradNorm | None = 1.0,
        fsdp_backend: FSDPBackend | None = None,
        algorithm: StageAlgorithm | None = None,
    ) -> None:
        check_literal_args(TrainStack.__init__, "stack", locals())
        self.cfg = TrainStackConfig(
            micro_batch_size=micro_batch_size,
            mini_batch_size=mini_batch_size,
            num_updates_per_batch=num_updates_per_batch,
            max_grad_norm=max_grad_norm,
        )
        if mini_batch_size is not None and mini_batch_size % micro_batch_size:
            raise ValueError(
                f"stack.mini_batch_size ({mini_batch_size}) must be a positive multiple of micro_batch_size ({micro_batch_size})"
            )
        if algorithm is not None and num_updates_per_batch > 1 and not algorithm.supports_multi_update:
            raise ValueError(
                f"stack.num_updates_per_batch={num_updates_per_batch} but {type(algorithm).__name__} does not "
                "support multiple updates per rollout batch; set it to 1"
            )
        if getattr(algorithm, "needs_shadow_policy", False) and fsdp_backend is not None and (
            getattr(fsdp_backend, "ema_lora_cfg", None) is None
        ):
            raise ValueError(
                f"{type(algorithm).__name__} needs the old policy of an EMA shadow adapter: set backend.ema_lora_cfg "
                "(unirl_ray.train.configs.EmaLoraConfig)"
            )
        self.backend = fsdp_backend
        self.algorithm = algorithm
        self.policy_version = 0

    def rank_mini_batch(self, shard_size: int, world_size: int) -> int:
        """Samples per optimizer step on one rank; ValueError if the shard cannot be split as configured."""
        global_mini = self.cfg.mini_batch_size or shard_size * world_size
        mini = global_mini // world_size
        if global_mini % world_size or shard_size % mini or mini % self.cfg.micro_batch_size:
            raise ValueError(
                f"{shard_size * world_size} samples per step on {world_size} rank(s) must split into mini-batches of "
                f"{global_mini} (over all ranks, so {global_mini / world_size:g} per rank) and per-rank micro-batches "
                f"of {self.cfg.micro_batch_size}; adjust stack.mini_batch_size / stack.micro_batch_size or the "
                "number of samples per step"
            )
        return mini

    def check_shard_size(self, shard_size: int, world_size: int = 1) -> None:
        """Raise ValueError if a per-rank shard of this size cannot be split as configured."""
        self.rank_mini_batch(shard_size, world_size)

    def train(self, samples: list[Sample], *, seed: int) -> TrainStepResult:
        """One RL step on this rank's shard (collective over ranks)."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        mini = self.rank_mini_batch(len(samples), world)
        t0 = time.perf_counter()
        segment = self.algorithm.prepare_segment(samples, seed=seed)
        t_prox = 0.0
        if getattr(self.algorithm, "needs_proximal", False):  # off-policy correction: pi_prox before any update
            t1 = time.perf_counter()
            segment["proximal_log_probs"] = self._proximal(samples, segment)
            t_prox = time.perf_counter() - t1
        sums: dict[str, float] = {}
        opt_metrics: dict[str, float] = {}
        n_opt = 0
        gen = torch.Generator().manual_seed(seed)
        t_loss = t_opt = 0.0
        for epoch in range(self.cfg.num_updates_per_batch):
            order = torch.randperm(len(samples), generator=gen).tolist()
            for start in range(0, len(samples), mini):
                batch = [samples[i] for i in order[start : start + mini]]
                t1 = time.perf_counter()
                part = self._mini_batch(batch, segment, first_pass=n_opt == 0)
                self._refuse_non_finite(part, n_opt)
                self._accumulate(sums, part)
                t2 = time.perf_counter()
                step = self.backend.optimizer_step(self.cfg.max_grad_norm)
                t_loss, t_opt = t_loss + t2 - t1, t_opt + time.perf_counter() - t2
                n_opt += 1
                for k, v in step.items():
                    opt_metrics[k] = opt_metrics.get(k, 0.0) + v
        ema_metrics = self.backend.update_ema(timing="rollout_end")  # the NFT "old" adapter moves once per step
        self.policy_version += 1
        metrics = self._reduce(sums, opt_metrics, n_opt)
        metrics.update(ema_metrics)
        metrics["timing/train_step"] = time.perf_counter() - t0
        metrics["timing/forward_backward"] = t_loss  # loss + backward of every micro-batch (rank 0)
        metrics["timing/optimizer_step"] = t_opt  # clip + AdamW + schedule (rank 0)
        if t_prox:
            metrics["timing/proximal_log_probs"] = t_prox  # the decoupled-PPO recompute (rank 0)
        return TrainStepResult(
            metrics=metrics,
            policy_version=self.policy_version,
            num_samples=len(samples) * world,
            num_optimizer_steps=n_opt,
        )

    def _refuse_non_finite(self, part: dict[str, float], n_opt: int, stage: str | None = None) -> None:
        """Collective: raise before the optimizer steps when a loss term of this mini-batch (of ``stage``, in a
        unified step) is not finite on any rank (every rank raises, so none waits in a collective). The
        weights stay those of the last finished step and nothing of this step reaches a checkpoint."""
        bad = sorted(k if stage is None else f"{stage}/{k}" for k, v in part.items()
                     if (k == "kl" or "loss" in k) and not math.isfinite(float(v)))
        flag = torch.tensor([1.0 if bad else 0.0], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            flag = flag.to(device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag.item()) > 0:
            where = f"{', '.join(bad)} on this rank" if bad else "on another rank"
            raise FloatingPointError(
                f"non-finite loss in mini-batch {n_opt + 1} of policy version {self.policy_version + 1} ({where}): "
                f"the optimizer did not step. Look at this step's rewards and advantages (reward/*, "
                f"algo/adv_abs_max) and at the learning rate; the last checkpoint is intact"
            )

    def _proximal(self, samples: list[Sample], segment: dict[str, Any],
                  algorithm: StageAlgorithm | None = None) -> dict[str, torch.Tensor]:
        """The algorithm's log-probs under the current weights (the proximal policy), per micro-batch, no grad."""
        algorithm = algorithm or self.algorithm
        out: dict[str, torch.Tensor] = {}
        micro = self.cfg.micro_batch_size
        with torch.no_grad():
            for start in range(0, len(samples), micro):
                out.update(algorithm.proximal_log_probs(samples[start : start + micro], segment, self.backend.module))
        return out

    def _mini_batch(self, batch: list[Sample], segment: dict[str, Any], *, first_pass: bool,
                    algorithm: StageAlgorithm | None = None, loss_weight: float = 1.0) -> dict[str, float]:
        """Loss + backward of every micro-batch of ``batch`` under ``algorithm`` (default: the stack's), its
        gradients weighted by ``loss_weight`` (a stage's weight in a unified step); returns the metric sums."""
        algorithm = algorithm or self.algorithm
        micro = self.cfg.micro_batch_size
        n_micro = (len(batch) + micro - 1) // micro
        sums: dict[str, float] = {}
        reference = self.backend.reference if algorithm.needs_reference else None
        shadow = self.backend.shadow_policy if getattr(self.backend, "adapter_ema", None) is not None else None
        global_units, world = self._global_units(batch, algorithm)
        even = len(batch) % micro == 0
        for start in range(0, len(batch), micro):
            chunk = batch[start : start + micro]
            ctx = LossContext(
                policy=self.backend.module,
                reference=reference,
                shadow_policy=shadow,
                # a micro-batch's share of a per-sample mean; a ragged last one (a unified stage) weighs its size
                loss_scale=loss_weight / n_micro if even else loss_weight * len(chunk) / len(batch),
                first_pass=first_pass,
                global_units=global_units / loss_weight,  # world / global_units then carries the weight too
                world_size=world,
                loss_weight=loss_weight,
            )
            part = algorithm.compute_loss_and_backward(chunk, segment, ctx)
            self._accumulate(sums, part)
        return sums

    def _global_units(self, batch: list[Sample], algorithm: StageAlgorithm | None = None) -> tuple[float, int]:
        """Loss units of this mini-batch summed over ranks (one tiny all-reduce), and the world size."""
        local = (algorithm or self.algorithm).loss_units(batch)
        if not (dist.is_available() and dist.is_initialized()):
            return local, 1
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        total = torch.tensor([local], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        return float(total.item()), dist.get_world_size()

    @staticmethod
    def _accumulate(into: dict[str, float], part: dict[str, float]) -> None:
        """Sum metric parts; keys ending in ``_max`` keep the maximum."""
        for k, v in part.items():
            into[k] = max(into.get(k, float(v)), float(v)) if k.endswith("_max") else into.get(k, 0.0) + float(v)

    def _reduce(self, sums: dict[str, float], opt: dict[str, float], n_opt: int) -> dict[str, float]:
        """Average metric sums over loss units on all ranks; optimizer metrics over steps."""
        return {**self._reduce_sums(sums), **_optimizer_metrics(opt, n_opt)}

    @staticmethod
    def _reduce_sums(sums: dict[str, float]) -> dict[str, float]:
        """Collective: metric sums of every rank -> means over their units (``train/loss``, ``algo/...``)."""
        sums = dict(sums)
        maxima = {k: sums.pop(k) for k in sorted(sums) if k.endswith("_max")}
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        peaks = torch.tensor(list(maxima.values()), dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            values, peaks = values.to(device), peaks.to(device)
            dist.all_reduce(values)
            if maxima:  # the same keys on every rank (same algorithm, same options)
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
            values, peaks = values.cpu(), peaks.cpu()
        totals = dict(zip(keys, values.tolist()))
        count = max(totals.pop("count", 1.0), 1.0)
        out: dict[str, float] = {f"algo/{k}": v for k, v in zip(maxima, peaks.tolist())}
        for k, v in totals.items():
            if k.endswith("_count"):
                continue
            denom = totals.get(f"{k}_count", count)
            if denom <= 0:
                continue
            prefix = "rollout/" if k == "logp_gap" else ("train/" if k in ("loss", "policy_loss", "kl") else "algo/")
            out[prefix + k] = v / denom
        return out


class UnifiedModelTrainStack(TrainStack):
    """Several stage algorithms over one backend, trained in one optimizer step (the unified model: a text
    stage and an image stage over the same backbone, e.g. ``{"text": GRPO, "image": FlowGRPO}``).

    Per epoch of a train step (``num_updates_per_batch`` epochs): each stage, in the order given, runs its
    micro-batches over its own Parts with its own loss units normalised over all ranks, its gradients
    weighted by ``loss_weights[stage]`` (default 1); then ONE optimizer step (clipped over every stage's
    gradients). So one step follows the gradient of ``sum_s w_s L_s``. pi_old is frozen once per stage
    (``prepare_segment``) before the first update, so at the start of a step every stage's ratio is 1.

    A stage trains each distinct Part once: the Parts of a shard that share a ``part_id`` (the text segment
    that several images were drawn from) are one Part to it. Metrics are per stage (``text/train/loss``,
    ``image/algo/clip_frac``, ``image/rollout/logp_gap``) plus the shared ``train/grad_norm``, ``train/lr``.
    """

    def __init__(
        self,
        *,
        loss_weights: dict[str, float] | None = None,
        micro_batch_size: PositiveInt = 1,
        num_updates_per_batch: PositiveInt = 1,
        max_grad_norm: GradNorm | None = 1.0,
        fsdp_backend: FSDPBackend | None = None,
        algorithm: dict[str, StageAlgorithm] | None = None,
    ) -> None:
        """
        Args:
            loss_weights: ``{stage: weight > 0}``; stages not named weigh 1.
            micro_batch_size: Parts per forward/backward of one stage on one rank (a memory knob).
            num_updates_per_batch: Epochs (one optimizer step each); > 1 needs every stage's
                ``supports_multi_update``.
            max_grad_norm: Clipping threshold over all stages' gradients (None: no clipping).
            algorithm: ``{stage: StageAlgorithm}``, given by the rank from the side's ``algorithm:`` mapping.
        """
        check_literal_args(UnifiedModelTrainStack.__init__, "stack", locals())
        if algorithm is not None and (not isinstance(algorithm, dict) or not algorithm
                                      or not all(isinstance(a, StageAlgorithm) for a in algorithm.values())):
            raise ValueError("UnifiedModelTrainStack trains several stages: its algorithm is a mapping "
                             "{stage: StageAlgorithm}, e.g. algorithm: {text: {_target_: unirl_ray.algorithms.GRPO, ...}, "
                             "image: {_target_: unirl_ray.algorithms.FlowGRPO, ...}}")
        stages = dict(algorithm or {})
        weights = {str(k): v for k, v in (loss_weights or {}).items()}
        unknown = sorted(set(weights) - set(stages)) if stages else []
        if unknown:
            raise ValueError(f"stack.loss_weights names stage(s) {', '.join(unknown)}, but the stages are "
                             f"{', '.join(stages)}")
        for name, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise ValueError(f"stack.loss_weights.{name} must be a finite number > 0, got {w!r} (to leave a "
                                 "stage untrained, remove it from the algorithm mapping)")
        if num_updates_per_batch > 1:
            single = sorted(n for n, a in stages.items() if not a.supports_multi_update)
            if single:
                raise ValueError(f"stack.num_updates_per_batch={num_updates_per_batch} but the algorithm of stage(s) "
                                 f"{', '.join(single)} does not support multiple updates per rollout batch; set it to 1")
        super().__init__(micro_batch_size=micro_batch_size, num_updates_per_batch=num_updates_per_batch,
                         max_grad_norm=max_grad_norm, fsdp_backend=fsdp_backend, algorithm=None)
        for name, alg in stages.items():
            if getattr(alg, "needs_shadow_policy", False) and fsdp_backend is not None and (
                    getattr(fsdp_backend, "ema_lora_cfg", None) is None):
                raise ValueError(f"stage {name!r}: {type(alg).__name__} needs the old policy of an EMA shadow adapter: "
                                 "set backend.ema_lora_cfg (unirl_ray.train.configs.EmaLoraConfig)")
            if alg.stage is None:
                alg.stage = name  # it takes the Parts routed to its stage
        self.stages = stages
        self.loss_weights = {name: float(weights.get(name, 1.0)) for name in stages}

    def check_shard_size(self, shard_size: int, world_size: int = 1) -> None:
        """Every rank needs a non-empty shard (micro-batches may be ragged: each stage has its own Part count)."""
        if shard_size < 1:
            raise ValueError(f"a unified train step needs at least one sample per rank, got {shard_size}")

    def stage_samples(self, stage: str, samples: list[Sample]) -> list[Sample]:
        """The samples whose Part ``stage`` trains, each distinct Part once (by ``part_id``, else by sample), in order."""
        return distinct_parts(samples, self.stages[stage].part_of)

    def train(self, samples: list[Sample], *, seed: int) -> TrainStepResult:
        """One step over every stage on this rank's shard (collective over ranks)."""
        import zlib

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.check_shard_size(len(samples), world)
        t0 = time.perf_counter()
        batches = {name: self.stage_samples(name, samples) for name in self.stages}
        segments, t_prox = {}, 0.0
        for name, alg in self.stages.items():
            segments[name] = alg.prepare_segment(batches[name], seed=zlib.crc32(f"{seed}:{name}".encode()))
            if getattr(alg, "needs_proximal", False):
                t1 = time.perf_counter()
                segments[name]["proximal_log_probs"] = self._proximal(batches[name], segments[name], alg)
                t_prox += time.perf_counter() - t1
        sums: dict[str, dict[str, float]] = {name: {} for name in self.stages}
        opt_metrics: dict[str, float] = {}
        n_opt = 0
        gen = torch.Generator().manual_seed(seed)
        t_loss = t_opt = 0.0
        for epoch in range(self.cfg.num_updates_per_batch):
            t1 = time.perf_counter()
            for name, alg in self.stages.items():  # the same order on every rank (FSDP collectives)
                batch = batches[name]
                order = torch.randperm(len(batch), generator=gen).tolist()
                part = self._mini_batch([batch[i] for i in order], segments[name], first_pass=epoch == 0,
                                        algorithm=alg, loss_weight=self.loss_weights[name])
                self._refuse_non_finite(part, n_opt, stage=name)
                self._accumulate(sums[name], part)
            t2 = time.perf_counter()
            step = self.backend.optimizer_step(self.cfg.max_grad_norm)
            t_loss, t_opt = t_loss + t2 - t1, t_opt + time.perf_counter() - t2
            n_opt += 1
            for k, v in step.items():
                opt_metrics[k] = opt_metrics.get(k, 0.0) + v
        ema_metrics = self.backend.update_ema(timing="rollout_end")
        self.policy_version += 1
        metrics: dict[str, float] = {}
        for name in self.stages:
            metrics |= {f"{name}/{k}": v for k, v in self._reduce_sums(sums[name]).items()}
            metrics[f"{name}/train/parts"] = float(len(batches[name]) * world)
        metrics |= _optimizer_metrics(opt_metrics, n_opt)
        metrics.update(ema_metrics)
        metrics["timing/train_step"] = time.perf_counter() - t0
        metrics["timing/forward_backward"] = t_loss
        metrics["timing/optimizer_step"] = t_opt
        if t_prox:
            metrics["timing/proximal_log_probs"] = t_prox
        return TrainStepResult(metrics=metrics, policy_version=self.policy_version,
                               num_samples=len(samples) * world, num_optimizer_steps=n_opt)


def distinct_parts(samples: list[Sample], part_of: Any) -> list[Sample]:
    """The samples of the distinct Parts ``part_of(sample)`` picks, in order: Parts that share a ``part_id`` (one
    text segment copied into each of its images) count once, by their first sample; Parts without one are
    their sample's own."""
    seen: set[str] = set()
    out = []
    for s in samples:
        part = part_of(s)
        key = f"part:{part.part_id}" if part.part_id is not None else f"sample:{s.sample_id}"
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _optimizer_metrics(opt: dict[str, float], n_opt: int) -> dict[str, float]:
    return {"train/grad_norm": opt.get("grad_norm", 0.0) / max(n_opt, 1),
            "train/lr": opt.get("lr", 0.0) / max(n_opt, 1),
            "train/optimizer_steps": float(n_opt)}
