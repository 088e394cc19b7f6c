"""Direct ("trainside") rollout: the train ranks generate with the very module they train.

No engine and no weight sync: the samples are exactly on-policy, so the log-probs recorded while
sampling equal the ones the stack recomputes at the start of the step.

Exception, on purpose: when the backend holds the NFT adapter pair (``backend.ema_lora_cfg``), the
EMA shadow adapter is the sampling ("old") policy of DiffusionNFT, so by default the rollout samples
with it (``sampling_policy``); the trained adapter takes over again when sampling ends.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal

import numpy as np
import torch

from unirl_ray.config.checks import PositiveInt, check_literal_args
from unirl_ray.core.sample import Sample


class TrainsideRollout:
    """Generate samples for a list of requests on this rank, ``micro_batch_size`` at a time."""

    def __init__(
        self,
        *,
        micro_batch_size: PositiveInt = 8,
        sampling_policy: Literal["auto", "trainable", "shadow"] = "auto",
        pipeline: Any = None,
        backend: Any = None,
    ) -> None:
        """
        Args:
            micro_batch_size: Prompts per sampling forward.
            sampling_policy: Weights that sample: ``trainable`` (the module being trained), ``shadow``
                (the EMA shadow adapter of ``backend.ema_lora_cfg``, DiffusionNFT's old policy) or
                ``auto`` (``shadow`` when the backend has ``ema_lora_cfg``, else ``trainable``).
        """
        check_literal_args(TrainsideRollout.__init__, "rollout", locals())
        has_shadow = getattr(backend, "ema_lora_cfg", None) is not None
        if sampling_policy == "shadow" and not has_shadow:
            raise ValueError(
                "rollout.sampling_policy='shadow' needs the EMA shadow adapter: set backend.ema_lora_cfg, "
                "or use sampling_policy: trainable"
            )
        self.micro_batch_size = micro_batch_size
        self.sampling_policy = sampling_policy
        self.pipeline = pipeline
        self.backend = backend
        self.samples_with_shadow = sampling_policy == "shadow" or (sampling_policy == "auto" and has_shadow)
        """Whether ``generate`` samples with the backend's shadow adapter."""


    @contextlib.contextmanager
    def _sampling_module(self) -> Iterator[Any]:
        """The module to sample with (``None``: the pipeline's own), gathered for the whole rollout."""
        if self.backend is None:
            yield None
            return
        with self.backend.sampling() as module:
            if not self.samples_with_shadow:
                yield module
                return
            with self.backend.shadow_policy() as shadow:
                yield shadow

    @torch.no_grad()
    def generate(self, requests: list[dict[str, Any]], *, policy_version: int) -> list[Sample]:
        """``requests``: dicts with ``sample_id, group_id, prompt, columns, seed`` (and ``group_seed``)."""
        samples: list[Sample] = []
        with self._sampling_module() as module:
            if hasattr(self.pipeline, "sample_requests"):  # several Parts per sample (the unified model)
                outputs = self.pipeline.sample_requests(requests, module=module, micro_batch_size=self.micro_batch_size)
                return samples_from_outputs(requests, outputs, policy_version)
            for start in range(0, len(requests), self.micro_batch_size):
                chunk = requests[start : start + self.micro_batch_size]
                prompts, seeds = [r["prompt"] for r in chunk], [int(r["seed"]) for r in chunk]
                outputs = self.pipeline.sample(prompts, seeds, module=module, **group_kwargs(self.pipeline, chunk))
                samples.extend(samples_from_outputs(chunk, outputs, policy_version))
        return samples


def group_kwargs(pipeline: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"group_seeds": [...]}`` for pipelines that draw per-group randomness (shared initial noise)."""
    if not getattr(pipeline, "needs_group_seeds", False):
        return {}
    missing = [r["sample_id"] for r in requests if "group_seed" not in r]
    if missing:
        raise ValueError(f"requests {missing[:3]} carry no group_seed, which the pipeline's shared initial noise needs")
    return {"group_seeds": [int(r["group_seed"]) for r in requests]}


def samples_from_outputs(requests: list[dict[str, Any]], outputs: list[tuple[Any, Any]], policy_version: int) -> list[Sample]:
    """Samples from a pipeline's ``(part, media)`` outputs (``part``: one Part or the list of a sample's Parts)
    for the requests that produced them."""
    return [
        Sample(
            sample_id=request["sample_id"],
            group_id=request["group_id"],
            prompt=request["prompt"],
            columns=dict(request.get("columns") or {}),
            parts=list(part) if isinstance(part, (list, tuple)) else [part],
            image=media if isinstance(media, np.ndarray) else None,
            policy_version=policy_version,
        )
        for request, (part, media) in zip(requests, outputs)
    ]
