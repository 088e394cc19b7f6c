"""``SFT``: supervised losses as a ``StageAlgorithm``, so that ``TrainStack`` runs them unchanged.

Two families, picked by the Part each example carries (``unirl_ray.data.sft_examples``):

- **Token sequences** (``SFTTextPart``): next-token cross-entropy on the trained target tokens
  (assistant turns, completions), summed over the micro-batch and normalised by the number of
  trained tokens of the whole optimizer step over all ranks (``loss_units`` -> ``ctx.global_units``;
  FSDP averages gradients over ranks, hence the ``world_size`` factor). Every token weighs the same
  however examples are spread over ranks, micro-batches and packed rows, so packing changes the
  speed, not the loss. Rows may pack several examples: ``collate_text`` restarts position ids per
  example and the model's packed-sequence attention keeps them apart (``check_packing`` verifies
  that the model honours it before the first packed step).
- **Images** (``SFTImagePart``, SD3 and other rectified-flow models): flow matching. The image is
  encoded with the frozen VAE (a posterior sample), a noise level ``sigma`` is drawn (logit-normal
  or uniform ``u``, then the scheduler's shift ``sigma = s u / (1 + (s - 1) u)``, as SD3 trains),
  ``x_t = (1 - sigma) x_0 + sigma eps`` and the transformer's velocity is regressed on
  ``eps - x_0``; the loss is the per-image mean squared error, averaged over the images of the
  optimizer step on all ranks. Noise, ``sigma`` and caption dropout come from each example's seed,
  so a re-run (a resume) draws the same ones.

There are no advantages, no old policy and no reference: ``compute_advantages`` is a no-op.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch

from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.config.checks import check_literal_args
from unirl_ray.core.sample import Sample
from unirl_ray.data.sft_examples import SFTImagePart, SFTTextPart, pack_rows

TimestepSampling = Literal["logit_normal", "uniform"]


def collate_text(parts: list[SFTTextPart], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows: ``input_ids`` [B, L], ``position_ids`` [B, L] (0 at the start of every example
    and of the padding tail) and ``target_mask`` [B, L-1] aligned with the shifted targets ``input_ids[:, 1:]``."""
    if not parts:
        raise ValueError("collate_text needs at least one SFTTextPart")
    length = max(2, max(len(p.input_ids) for p in parts))
    input_ids = torch.full((len(parts), length), pad_token_id, dtype=torch.long)
    positions = torch.zeros((len(parts), length), dtype=torch.long)
    targets = torch.zeros((len(parts), length), dtype=torch.float32)
    for b, p in enumerate(parts):
        n = len(p.input_ids)
        if sum(p.segment_lengths) != n:
            raise ValueError(f"row of {n} tokens has segment_lengths summing to {sum(p.segment_lengths)}")
        input_ids[b, :n] = p.input_ids
        targets[b, :n] = p.target_mask
        runs = [*p.segment_lengths] + ([length - n] if length > n else [])
        positions[b] = torch.cat([torch.arange(r) for r in runs])
    return {"input_ids": input_ids, "position_ids": positions, "target_mask": targets[:, 1:]}


class SFT(StageAlgorithm):
    """Supervised fine-tuning losses for token sequences and images (see the module docstring)."""

    supports_multi_update: ClassVar[bool] = False

    def __init__(
        self,
        *,
        timestep_sampling: TimestepSampling = "logit_normal",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        caption_dropout: float = 0.0,
        pipeline: Any = None,
    ) -> None:
        """
        Args:
            timestep_sampling: Images: how ``u`` in (0, 1) is drawn before the shift: ``logit_normal``
                (sigmoid of a normal, SD3's choice) or ``uniform``.
            logit_mean: Images, ``logit_normal``: mean of the normal.
            logit_std: Images, ``logit_normal``: standard deviation of the normal (> 0).
            caption_dropout: Images: probability that an example is trained with an empty caption
                (what classifier-free guidance needs at sampling time).
            pipeline: The built ``pipeline:`` section (injected).
        """
        super().__init__(pipeline=pipeline)
        check_literal_args(SFT.__init__, type(self).__name__, locals())
        if not logit_std > 0:
            raise ValueError(f"logit_std must be > 0, got {logit_std}")
        if not 0.0 <= caption_dropout < 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1), got {caption_dropout}")
        self.timestep_sampling = timestep_sampling
        self.logit_mean = float(logit_mean)
        self.logit_std = float(logit_std)
        self.caption_dropout = float(caption_dropout)
        if pipeline is not None and getattr(pipeline, "guidance_scale", 1.0) != 1.0:
            raise ValueError(
                "SFT trains the conditional velocity; classifier-free guidance only applies when sampling: set "
                "pipeline.guidance_scale=1.0 (and algorithm.caption_dropout > 0 to train the unconditional branch)"
            )

    def compute_advantages(self, samples: list[Sample]) -> dict[str, float]:
        """Supervised learning has no advantages: nothing to set."""
        return {}

    def loss_units(self, samples: list[Sample]) -> float:
        """Trained target tokens (token rows) or image weights (padding rows count 0)."""
        return float(sum(_units(_part(s)) for s in samples))

    def compute_loss_and_backward(
        self, samples: list[Sample], segment: dict[str, Any], ctx: LossContext
    ) -> dict[str, float]:
        """Summed loss of the micro-batch times ``world_size / global_units``; one ``backward``."""
        total, count = self.loss_sum(ctx.policy, [_part(s) for s in samples])
        denom = ctx.global_units if ctx.global_units > 0 else 1.0  # 0 only when nothing is trained (sum is 0)
        (total * (ctx.world_size / denom)).backward()
        return {"loss": float(total.detach()), "count": count}

    @torch.no_grad()
    def evaluate(self, module: torch.nn.Module, parts: list[Any]) -> tuple[float, float]:
        """(summed loss, loss units) of ``parts`` without gradients (held-out evaluation)."""
        total, count = self.loss_sum(module, parts)
        return float(total), count

    def loss_sum(self, module: torch.nn.Module, parts: list[Any]) -> tuple[torch.Tensor, float]:
        """(loss summed over the loss units, with grad; number of units) of one micro-batch."""
        if self.pipeline is None:
            raise ValueError("SFT needs pipeline=<the built pipeline section> (the trainer injects it)")
        kinds = {type(p) for p in parts}
        if kinds == {SFTTextPart}:
            return self._token_loss(module, parts)
        if kinds == {SFTImagePart}:
            return self._flow_matching_loss(module, parts)
        names = sorted(k.__name__ for k in kinds)
        raise ValueError(f"SFT trains SFTTextPart or SFTImagePart micro-batches of one kind, got {names}")

    # ------------------------------------------------------------------ token sequences
    def _token_loss(self, module: torch.nn.Module, parts: list[SFTTextPart]) -> tuple[torch.Tensor, float]:
        batch = collate_text(parts, int(self.pipeline.tokenizer.pad_token_id))
        logp = self.pipeline.teacher_forced_log_probs(module, batch["input_ids"], batch["position_ids"])
        mask = batch["target_mask"].to(logp.device)
        return -(logp * mask).sum(), float(mask.sum())

    @torch.no_grad()
    def check_packing(self, module: torch.nn.Module) -> float:
        """Collective (same calls on every rank): the largest log-prob gap between two sequences packed in
        one row and the same sequences alone; ``RuntimeError`` when the model lets packed sequences attend
        to each other (its attention ignores the restarting position ids)."""
        vocab = len(self.pipeline.tokenizer)
        a, c = torch.arange(5, 12) % vocab, torch.arange(20, 26) % vocab
        parts = [SFTTextPart(input_ids=t, target_mask=torch.ones(len(t)), segment_lengths=[len(t)]) for t in (a, c)]
        packed = pack_rows(parts, max_length=len(a) + len(c))[0]
        pad = int(self.pipeline.tokenizer.pad_token_id)
        single = [self.pipeline.teacher_forced_log_probs(module, **_inputs(collate_text([p], pad))) for p in parts]
        both = self.pipeline.teacher_forced_log_probs(module, **_inputs(collate_text([packed], pad)))[0]
        gap = max(
            (both[: len(a) - 1] - single[0][0]).abs().max().item(),
            (both[len(a) : len(a) + len(c) - 1] - single[1][0]).abs().max().item(),
        )
        dtype = next(module.parameters()).dtype
        tolerance = 1e-3 if dtype == torch.float32 else 5e-2
        if not gap <= tolerance:
            raise RuntimeError(
                f"data.packing: this model's attention does not keep packed sequences apart (log-prob gap {gap:.3g} "
                f"> {tolerance}); its attention implementation ignores position-id restarts. Set data.packing=false."
            )
        return gap

    # ------------------------------------------------------------------ images
    def _flow_matching_loss(self, module: torch.nn.Module, parts: list[SFTImagePart]) -> tuple[torch.Tensor, float]:
        pipeline = self.pipeline
        gens = [torch.Generator().manual_seed(int(p.seed)) for p in parts]
        drop = [bool(torch.rand((), generator=g) < self.caption_dropout) for g in gens]
        captions = ["" if d else p.caption for p, d in zip(parts, drop)]
        u = torch.stack([self._draw_u(g) for g in gens])
        shift = float(pipeline.bundle.scheduler.config.get("shift", 1.0))
        sigma = shift * u / (1 + (shift - 1) * u)
        x0 = pipeline.encode_images(torch.stack([p.pixels for p in parts]), generators=gens)
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in gens]).to(x0.device)
        sigma = sigma.to(x0.device)
        s = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - s) * x0 + s * noise
        cond = pipeline.encode_prompts(captions)
        v = pipeline.velocity(module, cond, x_t, sigma)
        mse = (v - (noise - x0).to(v.device)).pow(2).flatten(1).mean(dim=1)
        weights = torch.tensor([p.weight for p in parts], dtype=mse.dtype, device=mse.device)
        return (mse * weights).sum(), float(weights.sum())

    def _draw_u(self, gen: torch.Generator) -> torch.Tensor:
        if self.timestep_sampling == "uniform":
            return torch.rand((), generator=gen)
        return torch.sigmoid(self.logit_mean + self.logit_std * torch.randn((), generator=gen))


def _part(sample: Sample) -> Any:
    if len(sample.parts) != 1:
        raise ValueError(f"SFT samples carry exactly one Part, sample {sample.sample_id!r} has {len(sample.parts)}")
    return sample.parts[0]


def _units(part: Any) -> float:
    if isinstance(part, SFTTextPart):
        return float(part.num_targets)
    if isinstance(part, SFTImagePart):
        return float(part.weight)
    raise ValueError(f"SFT trains SFTTextPart / SFTImagePart, got {type(part).__name__}")


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}

