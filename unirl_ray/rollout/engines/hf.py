"""A dedicated rollout engine on Ray Serve that generates with the family's own pipeline (HF
``transformers`` / diffusers modules), so its log-probs are computed exactly as the trainer's.

Each replica builds the bundle and pipeline from the same recipe sections as the train workers
(plus the same LoRA structure; with ``stage`` in the sections it runs that stage of a multi-stage
pipeline only, ``pipeline.sample_stage``: one engine of the unified model's pair), then only ever generates with weights it was given: it starts at
version -1, loads versions through ``load_weights`` (verified by checksum) and, before generating,
pulls the latest published version from the run's ``WeightStore`` if it is behind what the
controller expects (a replica that started or restarted late catches up by itself).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import torch

from unirl_ray.config.recipe import instantiate
from unirl_ray.core.sample import Sample
from unirl_ray.rollout.trainside import group_kwargs, samples_from_outputs
from unirl_ray.rollout.weight_sync import state_checksum
from unirl_ray.rollout.engines.base import VersionedEngine, check_version, token_ids_in
from unirl_ray.train.backend.offload import StorageOffloader, own_storage

log = logging.getLogger(__name__)


class HFRolloutEngine(VersionedEngine):
    """Serve deployment body (wrapped with ``serve.deployment`` by ``DedicatedEngine.deploy``)."""

    def __init__(self, sections: dict[str, Any], store: tuple[str, str] | None = None, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.sections = sections
        self.bundle = instantiate(sections["bundle"])
        self.pipeline = instantiate(sections["pipeline"], bundle=self.bundle)
        self.module = getattr(self.bundle, sections.get("trainable_attr", "model"))
        self.stage = sections.get("stage")  # one stage of a multi-stage pipeline (the unified model's engine pair)
        if self.stage is not None and not hasattr(self.pipeline, "sample_stage"):
            raise ValueError(f"this engine serves stage {self.stage!r}, but {type(self.pipeline).__name__} has no stages")
        self.module.requires_grad_(False)
        if sections.get("lora_cfg"):
            from unirl_ray.train.backend.lora import inject_lora

            inject_lora(self.module, instantiate(sections["lora_cfg"]))
            self.module.requires_grad_(False)
        self.module.eval()
        # A replica started with `num_gpus` sees its GPU(s); generate there.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if hasattr(self.bundle, "to"):
            self.bundle.to(self.device)
        own_storage(m for m in vars(self.bundle).values() if isinstance(m, torch.nn.Module))  # freed while asleep
        self._offloader = StorageOffloader(self.device)
        self.store = store
        self.version = -1
        self.checksum: str | None = None
        self.lock = threading.Lock()
        self.replica = os.getpid()

    # --------------------------------------------------------------- weights
    def load_weights(self, version: int, state: dict[str, torch.Tensor], checksum: str) -> dict[str, Any]:
        """Load a published version (trainable weights only); refuse a corrupted transfer."""
        self._check_awake()  # an asleep replica has no weights to copy into; it catches up on wake
        t0 = time.perf_counter()
        got = state_checksum(state)
        if got != checksum:
            raise ValueError(f"weights v{version} arrived corrupted (checksum {got} != {checksum}); not loaded")
        with self.lock:
            names = dict(self.module.named_parameters())
            unknown = [k for k in state if k not in names]
            if unknown:
                raise ValueError(f"weights v{version} name parameters this engine lacks: {unknown[:5]}")
            wrong = [k for k, t in state.items() if tuple(t.shape) != tuple(names[k].shape)]
            if wrong:  # checked before any copy: a refused version never leaves the engine half-updated
                raise ValueError(f"weights v{version} have wrong shapes for {wrong[:5]}")
            with torch.no_grad():
                for name, tensor in state.items():  # reads the (shared, read-only) received bytes once
                    names[name].copy_(tensor.to(names[name].device, names[name].dtype))
            self.version, self.checksum = version, checksum
        return {**self.status(), "load_s": time.perf_counter() - t0}

    # ----------------------------------------------------------- sleep/wake
    def _release(self) -> int:
        """Copy the bundle's weights to the host and free their device storage (colocated layouts)."""
        with self.lock:
            return self._offloader.offload(self._tensors())

    def _restore(self) -> int:
        with self.lock:
            return self._offloader.onload()

    def _tensors(self) -> list[torch.Tensor]:
        modules = [m for m in vars(self.bundle).values() if isinstance(m, torch.nn.Module)]
        return [t for m in modules for t in (*m.parameters(), *m.buffers())]

    # ------------------------------------------------------------ generation
    def _generate(self, requests: list[dict[str, Any]], expected_version: int, at_least: bool = False) -> list[Sample]:
        self._check_awake()
        self._catch_up(expected_version)
        with self.lock, torch.no_grad():
            version = self.version  # read under the lock: a weight load waits for this call (never mixed)
            check_version(self.replica, version, expected_version, at_least)
            if self.stage is not None:
                outputs = self.pipeline.sample_stage(self.stage, requests, module=self.module,
                                                     micro_batch_size=len(requests))
            elif token_ids_in(requests):  # token in, token out: continue from the exact ids given
                outputs = self.pipeline.sample_ids([r["prompt_ids"] for r in requests],
                                                   [int(r["seed"]) for r in requests], module=self.module)
            elif getattr(self.pipeline, "samples_from_columns", False):  # e.g. a prompt's images in its columns
                outputs = self.pipeline.sample_requests(requests, module=self.module, micro_batch_size=len(requests))
            else:
                outputs = self.pipeline.sample(
                    [r["prompt"] for r in requests], [int(r["seed"]) for r in requests], module=self.module,
                    **group_kwargs(self.pipeline, requests),
                )
        return samples_from_outputs(requests, outputs, version)

    async def generate(self, requests: list[dict[str, Any]], expected_version: int, at_least: bool = False) -> list[Sample]:
        """Generate with weights ``expected_version`` (``at_least``: that version or a newer one; async
        trainers) on a worker thread so the replica's event loop stays responsive. Every sample is
        tagged with the version that generated it."""
        return await asyncio.to_thread(self._generate, requests, expected_version, at_least)
