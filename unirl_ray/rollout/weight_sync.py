"""Versioned, verified weight sync from the train workers to a dedicated rollout engine.

``TensorWeightSync.push``: rank 0 gathers the full trainable weights (full model, or LoRA adapters
only), the driver puts them in the object store once and records them in the run's
``WeightStore`` (so a replica that starts later pulls the latest version itself), every replica
loads them through ``handle.broadcast`` and reports ``(version, checksum)``; a mismatch is an
error, never a silent stale rollout.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from unirl_ray.core.wire import wire


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """Content hash of a state dict (names, dtypes, shapes and bytes), order-independent."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        if tensor.untyped_storage().data_ptr() == state[name].untyped_storage().data_ptr():
            tensor = tensor.clone()  # .numpy() would pin a live parameter's storage (no offload afterwards)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class StaleWeightsError(RuntimeError):
    """An engine replica does not serve the version the controller expects."""


def _weight_store_cls():
    import ray

    @ray.remote(num_cpus=0)
    class WeightStore:
        """Holds the latest published weights (an ObjectRef inside a list, so it is not resolved)."""

        def __init__(self) -> None:
            self.latest: dict[str, Any] | None = None

        def publish(self, version: int, ref_box: list, checksum: str) -> None:
            self.latest = {"version": version, "ref": ref_box, "checksum": checksum}

        def get_latest(self) -> dict[str, Any] | None:
            return self.latest

    return WeightStore


def create_weight_store(name: str, namespace: str):
    """A named, detached-from-nothing store actor owned by the driver (dies with the job)."""
    return _weight_store_cls().options(name=name, namespace=namespace, get_if_exists=True).remote()


@dataclass(kw_only=True)
class TensorWeightSync:
    """When and how the controller pushes weights to the dedicated engine."""

    every: int = 1
    """Push after every N train steps (N > 1 makes rollouts up to N-1 versions stale)."""
    timeout_s: float = 300.0
    """Longest wait for every replica to load a version."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"sync.every must be >= 1, got {self.every}")

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def push(self, group: Any, engine: Any, version: int, side: str | None = None) -> dict[str, float]:
        """Export from the train ranks (side ``side`` where the ranks hold several), publish once, load on
        every replica, verify."""
        t0 = time.perf_counter()
        ref, checksum, metrics = self.export(group, version, side)
        engine.publish(version, ref, checksum, timeout_s=self.timeout_s)
        return {**metrics, "weight_sync/seconds": time.perf_counter() - t0}

    def export(self, group: Any, version: int, side: str | None = None) -> tuple[Any, str, dict[str, float]]:
        """Gather the trainable weights from the train ranks into the object store once:
        ``(object ref, checksum, metrics)``; ``engine.publish`` then loads and verifies them."""
        import ray

        t0 = time.perf_counter()
        exported = group.call("export_weights", {} if side is None else {"side": side})[0]
        if int(exported["policy_version"]) != int(version):
            raise RuntimeError(f"the train ranks exported weights v{exported['policy_version']} for a publish of v{version}")
        state, checksum = exported["state"], exported["checksum"]
        ref = ray.put(wire(state))  # replicas get the dict of tensors back, without torch's slow pickling
        return ref, checksum, {
            "weight_sync/export_seconds": time.perf_counter() - t0,
            "weight_sync/bytes": float(state_bytes(state)),
            "weight_sync/version": float(version),
        }
