"""What a train rank holds: bundle, pipeline, backend, algorithm, stack and (trainside) rollout.

Built once per worker from the recipe sections, in the seed's order::

    bundle    = build(bundle_cfg)
    pipeline  = build(pipeline_cfg, bundle=bundle)
    backend   = build(backend_cfg, bundle=bundle)            # FSDPBackend
    algorithm = build(algorithm_cfg, pipeline=pipeline)      # StageAlgorithm
    stack     = build(stack_cfg, fsdp_backend=backend, algorithm=algorithm)
    rollout   = build(rollout_cfg, pipeline=pipeline, backend=backend)   # trainside rollout

Plain Python (no Ray): the worker loop in ``runtime.worker`` drives it, and tests and benchmarks
can drive it directly in one process. Its commands are the methods marked ``@operation``
(``runtime.operations``): the runtime dispatches ``TrainGroup.call(name, payload)`` to them by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unirl_ray.config.recipe import instantiate
from unirl_ray.core.sample import Sample, complete_sample
from unirl_ray.runtime.operations import operation
from unirl_ray.train.configs import TrainTopology

if TYPE_CHECKING:
    from unirl_ray.train.export import ExportInfo

log = logging.getLogger(__name__)


class StackWorker:
    """One train rank's objects and the operations the controller asks of them."""

    def __init__(self, sections: dict[str, Any], *, topology: TrainTopology, device: torch.device,
                 open_shard: Callable[[str], Callable[[], Any] | None] | None = None) -> None:
        """``open_shard(name)``: a function that starts a new epoch over this rank's shard of Ray Data
        dataset ``name`` (None when the run has no such dataset); given by the worker program."""
        self.topology = topology
        self.device = device
        self.open_shard = open_shard or (lambda name: None)
        self.bundle = instantiate(sections["bundle"])
        if hasattr(self.bundle, "to"):
            self.bundle.to(device)
        self.pipeline = instantiate(sections["pipeline"], bundle=self.bundle)
        self.backend = instantiate(sections["backend"], bundle=self.bundle)
        self.algorithm = instantiate(sections["algorithm"], pipeline=self.pipeline)
        self.stack = instantiate(sections["stack"], fsdp_backend=self.backend, algorithm=self.algorithm)
        self.backend.setup(topology=topology, device=device, needs_reference=self.algorithm.needs_reference)
        self.rollout = None
        if sections.get("rollout") is not None:
            self.rollout = instantiate(
                sections["rollout"], pipeline=self.pipeline, backend=self.backend
            )
        self._cache: dict[str, Sample] = {}

    @property
    def policy_version(self) -> int:
        return self.stack.policy_version

    # ------------------------------------------------------------------ ops
    @operation
    def generate(self, requests: list[dict[str, Any]]) -> list[Sample]:
        """Trainside rollout of this rank's requests; keeps full samples, returns light ones."""
        if self.rollout is None:
            raise ValueError("this recipe has no trainside rollout section (rollout: _target_: ...)")
        samples = self.rollout.generate(requests, policy_version=self.policy_version)
        self._cache = {s.sample_id: s for s in samples}
        return [s.light() for s in samples]

    @operation
    def eval_generate(self, requests: list[dict[str, Any]], use_ema: bool = False) -> list[Sample]:
        """Collective: sample ``requests`` with the trained module, with its EMA weights when ``use_ema``
        (``backend.ema_weights()`` swaps them back bit for bit); returns light samples (images kept)."""
        import contextlib

        from unirl_ray.rollout.trainside import TrainsideRollout

        rollout = TrainsideRollout(micro_batch_size=getattr(self.rollout, "micro_batch_size", 8),
                                   sampling_policy="trainable", pipeline=self.pipeline, backend=self.backend)
        with self.backend.ema_weights() if use_ema else contextlib.nullcontext():
            samples = rollout.generate(requests, policy_version=self.policy_version)
        return [s.light() for s in samples]

    @operation
    def train(self, samples: list[Sample], *, seed: int) -> dict[str, Any]:
        """Train on this rank's shard; light samples are completed from the rollout cache."""
        shard = [self._complete(s) for s in samples]
        result = self.stack.train(shard, seed=seed)
        self._cache.clear()
        return {
            "metrics": result.metrics,
            "policy_version": result.policy_version,
            "num_samples": result.num_samples,
        }

    def _complete(self, sample: Sample) -> Sample:
        if not sample.is_light:
            return sample
        cached = self._cache.get(sample.sample_id)
        if cached is None:
            raise KeyError(
                f"sample {sample.sample_id} carries no trajectory and is not in this rank's rollout cache; "
                "samples of a trainside rollout must be trained on the rank that generated them"
            )
        return complete_sample(sample, cached)  # every score the driver set, the sample's and each Part's

    @operation
    def export_weights(self) -> dict[str, Any]:
        """Collective: the full trainable weights (LoRA adapters only with LoRA) on rank 0."""
        from unirl_ray.rollout.weight_sync import state_checksum

        state = self.backend.full_trainable_state_dict()
        if self.topology.rank != 0:
            return {}
        return {"state": state, "checksum": state_checksum(state), "policy_version": self.policy_version}

    @operation
    def export(self, directory: str, merge_lora: bool = True, overwrite: bool = False) -> ExportInfo | None:
        """Collective: write the trained model as a ``from_pretrained`` folder on rank 0 (``train.export``).

        Returns the ``ExportInfo`` on rank 0, ``None`` on the other ranks.
        """
        from unirl_ray.train.export import export_model

        return export_model(
            self.bundle,
            self.backend,
            directory,
            merge_lora=merge_lora,
            overwrite=overwrite,
            policy_version=self.policy_version,
        )

    # ---------------------------------------------------- colocated turns
    @operation
    def offload(self) -> dict[str, int]:
        """Hand this rank's device memory to a colocated engine: ``bytes`` freed and ``resident_bytes``
        (device bytes the train state still holds: 0 when everything moved)."""
        return {"bytes": self.backend.offload(), "resident_bytes": self.backend.device_bytes()}

    @operation
    def onload(self) -> dict[str, int]:
        """Take the device memory back (bit for bit) before training."""
        return {"bytes": self.backend.onload(), "resident_bytes": self.backend.device_bytes()}

    # ------------------------------------------------------------------ SFT
    @operation
    def sft_start(self, source: Any, records_per_rank: int, cursor: dict[str, int]) -> dict[str, Any]:
        """Build this rank's SFT feed (``data.sft_feed``) over its shards of datasets ``train`` and
        ``eval`` and move it to ``cursor``; ``source`` is the driver's ``RecordSource``."""
        from unirl_ray.data.sft_feed import SFTFeed

        self.sft_feed = SFTFeed(
            source, records_per_rank=int(records_per_rank), bundle=self.bundle,
            pipeline=self.pipeline, algorithm=self.algorithm, stack=self.stack, rank=self.topology.rank,
            world_size=self.topology.world_size, open_train=self.open_shard("train"), open_eval=self.open_shard("eval"),
        )
        self.sft_feed.seek(cursor)
        return {"cursor": self.sft_feed.cursor()}

    @operation
    def sft_train(self, seeds: list[int]) -> list[dict[str, Any]]:
        """Collective: one SFT optimizer step per seed on records this rank pulls from its shard."""
        if getattr(self, "sft_feed", None) is None:
            raise RuntimeError("this rank has no SFT feed: sft_start must come first (did the worker group restart?)")
        return self.sft_feed.train(seeds)

    @operation
    def sft_eval(self) -> dict[str, Any]:
        """Collective: this rank's summed held-out loss (one pass over the held-out records)."""
        if getattr(self, "sft_feed", None) is None:
            raise RuntimeError("this rank has no SFT feed: sft_start must come first (did the worker group restart?)")
        return self.sft_feed.evaluate()

    # ----------------------------------------------------------- checkpoint
    def save(self, directory: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        meta = self.backend.save(directory)
        meta["policy_version"] = self.stack.policy_version
        log.debug("rank %d saved shards in %.2fs", self.topology.rank, time.perf_counter() - t0)
        return meta

    def load(self, directory: str, meta: dict[str, Any]) -> None:
        self.backend.load(directory, meta)
        self.stack.policy_version = int(meta["policy_version"])
