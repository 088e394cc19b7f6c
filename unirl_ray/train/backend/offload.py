"""Move the backend's device memory to the host and back, in place.

A colocated rollout engine takes turns with training on the same device: between train steps the
parameters, gradients, optimizer state (and EMA shadows, buffers) must give their device memory
back. Every tensor keeps its identity (the optimizer's state keys, FSDP2's views into the sharded
storage, the peft modules all stay valid): the bytes of each distinct device *storage* are copied
to a host buffer, then the storage is resized to 0, which returns its memory to the allocator.
Onload resizes each storage back and copies the bytes in, so training resumes bit-identically.
"""

from __future__ import annotations

from typing import Iterable

import torch

from unirl_ray.train.backend.wrap import local


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` becomes ``cuda:<current device>``.

    Tensors report indexed devices (``cuda:0``) and ``torch.device("cuda") != torch.device("cuda:0")``,
    so comparisons against an unindexed device would silently match nothing.
    """
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            return torch.device(device.type, module.current_device())
    return device


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage`` (views, padding and all)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@torch.no_grad()
def own_storage(modules: Iterable[torch.nn.Module | None]) -> int:
    """Give every parameter and buffer of ``modules`` whose storage is not its own (memory-mapped from a
    ``from_pretrained`` checkpoint: not resizable, so it could never be freed while a colocated engine holds
    the device) a copy it owns, in place (a tied weight stays tied: it is one Parameter). Returns the
    tensors copied."""
    copied, seen = 0, set()
    for module in modules:
        if module is None:
            continue
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if tensor.device.type != "meta" and not tensor.untyped_storage().resizable():
                tensor.data = tensor.data.clone()
                copied += 1
    return copied


class StorageOffloader:
    """Holds host copies of device storages while they are freed."""

    def __init__(self, device: torch.device) -> None:
        self.device = canonical_device(device)
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self.offloaded = False
        """True between ``offload`` and ``onload``."""

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Copy every distinct storage on the device to the host, then free it. Returns bytes freed."""
        if self.offloaded:
            return 0
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            if tensor is None:
                continue
            t = local(tensor)
            if t.device != self.device:
                continue  # already on the host (e.g. FSDP2 CPU offload keeps shards there)
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in storages:
                continue
            if not storage.resizable():
                raise RuntimeError(
                    f"cannot offload a non-resizable storage of a {tuple(t.shape)} tensor "
                    "(created from external memory); keep that tensor off the backend's modules"
                )
            storages[storage.data_ptr()] = storage
        pin = self.device.type == "cuda"
        freed = 0
        for storage in storages.values():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes(storage))
            self._held.append((storage, host))
        if pin:
            torch.cuda.synchronize(self.device)
        for storage, host in self._held:  # free only once every copy is done
            freed += storage.nbytes()
            storage.resize_(0)
        self.offloaded = True
        return freed

    @torch.no_grad()
    def onload(self) -> int:
        """Reallocate every freed storage on the device and copy its bytes back. Returns bytes restored."""
        if not self.offloaded:
            return 0
        restored = 0
        for storage, host in self._held:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=host.is_pinned())
            restored += host.numel()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._held = []
        self.offloaded = False
        return restored
