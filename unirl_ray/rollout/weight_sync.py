"""Versioned, verified weight sync from the train workers to a dedicated rollout engine.

``TensorWeightSync.push``: rank 0 gathers the full trainable weights (full model, or LoRA adapters
only), puts them in the object store once and stages the reference in the engine's ``WeightStore``;
the driver records them as the store's latest version (a replica that starts later pulls it itself),
every replica loads them through ``handle.broadcast`` (replicas of one node map the same copy) and
reports ``(version, checksum)``; a mismatch is an error, never a silent stale rollout. The weights
never pass through the driver.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from unirl_ray.core.wire import wire


_CHUNK_BYTES = 32 << 20
_hash_pool: Any = None


def _flat_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat, flat.numel() * flat.element_size()


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """Content hash of a state dict (names, dtypes, shapes and bytes), order-independent.

    Every byte is hashed with XXH3-128 in slices of ``_CHUNK_BYTES``, read in place through the tensor's
    address (``_address_view``: no copy of a contiguous CPU tensor), the slices of all tensors spread over
    a small thread pool (xxhash releases the GIL; ~30 GB/s per core here, near the memory's own speed,
    against ~2 GB/s for SHA-256: a sync checks every byte on the train rank and on every replica). The
    slices' digests, with every tensor's name, dtype and shape, are then hashed with BLAKE2b. A guard
    against what a transfer can do (a stale, truncated, misplaced or corrupted tensor), not against a
    forger: the bytes come from this run's own processes."""
    global _hash_pool
    if _hash_pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _hash_pool = ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                        thread_name_prefix="unirl-checksum")
    names = sorted(state)
    flats = [_flat_bytes(state[name]) for name in names]
    views = [_address_view(flat) if nbytes else None for flat, nbytes in flats]
    slices = [(i, start) for i, (_, nbytes) in enumerate(flats) for start in range(0, nbytes, _CHUNK_BYTES)]
    try:
        digests = list(_hash_pool.map(
            lambda item: xxhash.xxh3_128_digest(views[item[0]][item[1] : item[1] + _CHUNK_BYTES]), slices))
    finally:
        for view in views:
            if view is not None:
                view.release()
        del flats  # held until every slice is read
    digest = hashlib.blake2b(digest_size=16)
    by_tensor: dict[int, list[bytes]] = {}
    for (i, _), chunk in zip(slices, digests):
        by_tensor.setdefault(i, []).append(chunk)
    for i, name in enumerate(names):
        tensor, chunks = state[name], by_tensor.get(i, [])
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{len(chunks)}|".encode())
        digest.update(b"".join(chunks))
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
            self.staged: dict[str, Any] | None = None

        def stage(self, version: int, ref_box: list, checksum: str) -> None:
            """Rank 0 exported ``version`` (the reference keeps its object alive); the driver publishes it next."""
            self.staged = {"version": version, "ref": ref_box, "checksum": checksum}

        def get_staged(self) -> dict[str, Any] | None:
            return self.staged

        def publish(self, version: int, ref_box: list, checksum: str) -> None:
            self.latest = {"version": version, "ref": ref_box, "checksum": checksum}

        def get_latest(self) -> dict[str, Any] | None:
            return self.latest

    return WeightStore


def create_weight_store(name: str, namespace: str):
    """A named, detached-from-nothing store actor owned by the driver (dies with the job)."""
    from unirl_ray.runtime.cluster import on_driver_node

    return _weight_store_cls().options(name=name, namespace=namespace, get_if_exists=True, **on_driver_node()).remote()


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
        """Export from the train ranks (side ``side`` where the ranks hold several) into the engine's store,
        publish, load on every replica, verify."""
        t0 = time.perf_counter()
        ref, checksum, metrics = self.export(group, version, side, store=engine.store_id)
        metrics.update(engine.publish(version, ref, checksum, timeout_s=self.timeout_s))
        return {**metrics, "weight_sync/seconds": time.perf_counter() - t0}

    def export(self, group: Any, version: int, side: str | None = None, *,
               store: tuple[str, str] | None = None) -> tuple[Any, str, dict[str, float]]:
        """Gather the trainable weights from the train ranks into the object store once:
        ``(object ref, checksum, metrics)``; ``engine.publish`` then loads and verifies them.

        ``store`` (``(name, namespace)`` of a ``WeightStore``): rank 0 puts the weights in the object store
        itself and stages the reference there; only the reference reaches the driver. Without
        one the weights come back through the driver, which puts them (one copy more on the way)."""
        import ray

        t0 = time.perf_counter()
        payload = {} if side is None else {"side": side}
        if store is not None:
            payload["stage_in"] = list(store)
        exported = group.call("export_weights", payload)[0]
        if int(exported["policy_version"]) != int(version):
            raise RuntimeError(f"the train ranks exported weights v{exported['policy_version']} for a publish of v{version}")
        checksum = exported["checksum"]
        if store is None:
            state = exported["state"]
            nbytes = state_bytes(state)
            ref = ray.put(wire(state))  # replicas get the dict of tensors back, without torch's slow pickling
        else:
            staged = ray.get(ray.get_actor(store[0], namespace=store[1]).get_staged.remote(), timeout=60)
            if staged is None or staged["version"] != version or staged["checksum"] != checksum:
                raise StaleWeightsError(f"rank 0 staged {staged and staged['version']} in {store[0]!r} for a "
                                        f"publish of v{version} (checksum {checksum})")
            ref, nbytes = staged["ref"][0], exported["bytes"]
        return ref, checksum, {
            "weight_sync/export_seconds": time.perf_counter() - t0,
            "weight_sync/bytes": float(nbytes),
            "weight_sync/version": float(version),
            # on rank 0: gathering the full weights, their checksum, the put into the object store
            **{f"weight_sync/{k}": float(v) for k, v in exported.get("timings", {}).items()},
        }


def _address_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place, without ``.numpy()`` (which would make a live
    parameter's storage unresizable: colocated layouts free it with ``resize_(0)``)."""
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array.keep_alive = tensor  # the view holds the array, the array the tensor: the memory outlives the view
    return memoryview(array).cast("B")


def _tensor_from_buffer(buffer: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``buffer`` (no copy). From the object store it is read-only shared memory that every
    replica of the node maps: load from it, never write into it."""
    import warnings

    if not len(memoryview(buffer)):
        return torch.empty(shape, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given buffer is not writable"
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


class _BufferTensor:
    """A CPU tensor that pickles (protocol 5) as one out-of-band buffer read from its memory in place: the
    object store copies it once from the live weights, and replicas get tensors over the stored bytes."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach().cpu().contiguous()

    def __reduce_ex__(self, protocol: int) -> tuple[Any, tuple[Any, ...]]:
        t = self.tensor
        data = pickle.PickleBuffer(_address_view(t)) if protocol >= 5 else _address_view(t).tobytes()
        return _tensor_from_buffer, (data, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def stage_weights(state: dict[str, torch.Tensor], version: int, store: tuple[str, str]) -> dict[str, Any]:
    """On train rank 0: put ``state`` in the object store once and stage it in the ``WeightStore`` named
    ``store`` for the driver to publish. This process owns the object (it lives while the store or an
    engine holds it, and at most as long as this worker: a restarted worker group publishes again).

    The checksum is computed while the object store copies the bytes (both only read them); returns
    ``{"checksum", "checksum_s", "put_s"}`` (the two phases overlap)."""
    import ray
    from concurrent.futures import ThreadPoolExecutor

    actor = ray.get_actor(store[0], namespace=store[1])

    def timed_checksum() -> tuple[str, float]:
        start = time.perf_counter()
        return state_checksum(state), time.perf_counter() - start

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="unirl-checksum-state") as pool:
        pending = pool.submit(timed_checksum)
        # one copy, from the weights into the object store (ray.put returns once it is there: a snapshot)
        ref = ray.put({name: _BufferTensor(t) for name, t in state.items()})
        put_s = time.perf_counter() - t0
        checksum, checksum_s = pending.result()
    ray.get(actor.stage.remote(version, [ref], checksum), timeout=60)
    return {"checksum": checksum, "checksum_s": checksum_s, "put_s": put_s}
