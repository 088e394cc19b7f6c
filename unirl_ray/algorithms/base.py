"""``StageAlgorithm``: the math of one training stage, pure torch and free of Ray.

The driver calls ``compute_advantages`` on the whole step's samples (groups span ranks); each train
worker then runs, per rollout shard, ``prepare_segment`` once (freezes pi_old) and
``compute_loss_and_backward`` on micro-batches. The ``TrainStack`` owns the ordering, the optimizer
steps and the reduction of metrics; the algorithm never touches the optimizer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from unirl_ray.core.sample import Part, Sample, part_advantage, routed_part


@dataclass(kw_only=True)
class LossContext:
    """What the stack hands the algorithm for one micro-batch."""

    policy: torch.nn.Module
    """The trainable module (FSDP2-wrapped on the train workers)."""
    reference: Callable[[], AbstractContextManager[torch.nn.Module]] | None
    """Context manager factory yielding the frozen reference module (``None``: no reference)."""
    shadow_policy: Callable[[], AbstractContextManager[torch.nn.Module]] | None = None
    """Context manager factory yielding the policy with its EMA shadow adapter active: the "old" /
    sampling policy of DiffusionNFT (``backend.ema_lora_cfg``; ``None`` without one)."""
    loss_scale: float
    """Multiply the loss by this before ``backward`` (micro-batch share of the optimizer step)."""
    first_pass: bool
    """True while no optimizer step has been taken on this segment yet (params equal pi_old)."""
    global_units: float = 1.0
    """``loss_units`` of this optimizer step's mini-batch summed over all ranks (e.g. valid tokens)."""
    world_size: int = 1
    """Data-parallel ranks; FSDP averages gradients over them, so a global sum-normalised loss
    multiplies by ``world_size / global_units`` to be normalised by the global count."""
    loss_weight: float = 1.0
    """This stage's weight in a ``UnifiedModelTrainStack`` step (1 in a single-stage stack). Informational:
    the stack has already folded it into ``loss_scale`` and ``global_units``, so a loss normalised either
    way carries it without reading this field."""


class StageAlgorithm(ABC):
    """Base class of every RL / supervised algorithm of one stage."""

    supports_multi_update: ClassVar[bool] = False
    """Whether ``num_updates_per_batch > 1`` (PPO-style epochs over one rollout) is sound."""
    part_type: ClassVar[type[Part]] = Part
    """The kind of Part this algorithm trains (``TextPart``, ``DiffusionPart``)."""
    stage: str | None = None
    """The side / stage this algorithm trains (set by the rank that builds it); it takes the Parts routed
    to that stage (``Part.stage``). ``None``: a single-side recipe, whose samples hold one such Part."""

    def __init__(self, *, pipeline: Any = None) -> None:
        self.pipeline = pipeline

    def part_of(self, sample: Sample) -> Part:
        """The Part of ``sample`` this algorithm trains (``core.sample.routed_part``)."""
        return routed_part(sample, self.part_type, self.stage)

    def advantages(self, samples: list[Sample]) -> torch.Tensor:
        """[B] the advantage each sample's Part trains on: the Part's own, else the sample's."""
        return torch.tensor([part_advantage(s, self.part_of(s)) for s in samples], dtype=torch.float32)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss needs the frozen reference model (e.g. a KL term)."""
        return False

    @abstractmethod
    def compute_advantages(self, samples: list[Sample]) -> dict[str, float]:
        """Set ``sample.advantage`` for every sample in place (driver side); return ``algo/`` metrics."""

    def loss_units(self, samples: list[Sample]) -> float:
        """What the loss is normalised by for these samples (default: one unit per sample).

        Token-level losses return the number of valid tokens; the stack sums this over the
        mini-batch and all ranks and passes it as ``LossContext.global_units``.
        """
        return float(len(samples))

    @property
    def needs_proximal(self) -> bool:
        """Whether the loss needs the proximal policy's log-probs (decoupled off-policy correction): the
        stack then calls ``proximal_log_probs`` on every micro-batch of the shard before the first update
        and stores the result in ``segment["proximal_log_probs"]``."""
        return False

    def proximal_log_probs(
        self, samples: list[Sample], segment: dict[str, Any], policy: torch.nn.Module
    ) -> dict[str, torch.Tensor]:
        """``{sample_id: log-probs}`` of ``samples`` under ``policy`` now (no grad); see ``needs_proximal``."""
        raise TypeError(f"{type(self).__name__} has no proximal log-probs: it trains without an off-policy correction")

    def prepare_segment(self, samples: list[Sample], *, seed: int) -> dict[str, Any]:
        """Freeze pi_old for one rollout shard; return per-segment state for the loss.

        Called once per shard before the first update; ``seed`` makes random choices
        (e.g. timestep subsets) identical on a re-run of the same step.
        """
        return {}

    @abstractmethod
    def compute_loss_and_backward(
        self, samples: list[Sample], segment: dict[str, Any], ctx: LossContext
    ) -> dict[str, float]:
        """Compute the loss of a micro-batch, call ``backward`` on ``loss * ctx.loss_scale``.

        Returns per-micro-batch metric sums keyed by name plus ``"count"`` (the number of loss
        units they sum over), so the stack can average them over micro-batches and ranks.
        """
