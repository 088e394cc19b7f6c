"""Direct ("trainside") rollout: the train ranks generate with the very module they train.

No engine and no weight sync: the samples are exactly on-policy, so the log-probs recorded while
sampling equal the ones the stack recomputes at the start of the step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from unirl_ray.core.sample import Sample


class TrainsideRollout:
    """Generate samples for a list of requests on this rank, ``micro_batch_size`` at a time."""

    def __init__(self, *, micro_batch_size: int = 8, pipeline: Any = None, backend: Any = None) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"rollout.micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.pipeline = pipeline
        self.backend = backend

    @torch.no_grad()
    def generate(self, requests: list[dict[str, Any]], *, policy_version: int) -> list[Sample]:
        """``requests``: dicts with ``sample_id, group_id, prompt, columns, seed``."""
        samples: list[Sample] = []
        with self.backend.sampling() if self.backend is not None else contextlib.nullcontext() as module:
            for start in range(0, len(requests), self.micro_batch_size):
                chunk = requests[start : start + self.micro_batch_size]
                prompts, seeds = [r["prompt"] for r in chunk], [int(r["seed"]) for r in chunk]
                outputs = self.pipeline.sample(prompts, seeds, module=module)
                samples.extend(samples_from_outputs(chunk, outputs, policy_version))
        return samples


def samples_from_outputs(requests: list[dict[str, Any]], outputs: list[tuple[Any, Any]], policy_version: int) -> list[Sample]:
    """Samples from a pipeline's ``(part, media)`` outputs for the requests that produced them."""
    return [
        Sample(
            sample_id=request["sample_id"],
            group_id=request["group_id"],
            prompt=request["prompt"],
            columns=dict(request.get("columns") or {}),
            parts=[part],
            image=media if isinstance(media, np.ndarray) else None,
            policy_version=policy_version,
        )
        for request, (part, media) in zip(requests, outputs)
    ]
