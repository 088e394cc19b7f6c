"""Fast pickling of CPU tensors between this job's processes.

torch's own tensor pickling writes every storage through ``torch.save``: about a millisecond per
small tensor, and a view drags its whole storage along. Samples, state dicts and command payloads
cross several processes per step (engine, rollout stream, driver, train ranks, engine again), so
they carry CPU tensors as numpy arrays instead: pickle protocol 5 moves those as one buffer
(zero-copy out of band where Ray's object store serialises them).

``pack_tree`` / ``unpack_tree`` convert tensors inside plain dicts, lists and tuples (anything else is
left to its own pickling); ``wire(obj)`` wraps an object so that unpickling it gives back ``obj`` with
its tensors restored; ``Part`` (``unirl_ray.core.sample``) packs its fields the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAPPINGS = (dict, OrderedDict)


class PackedTensor:
    """A CPU tensor as a numpy array plus its torch dtype name."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray, dtype: str) -> None:
        self.array, self.dtype = array, dtype

    def __getstate__(self) -> tuple[np.ndarray, str]:
        return self.array, self.dtype

    def __setstate__(self, state: tuple[np.ndarray, str]) -> None:
        self.array, self.dtype = state


def pack_tensor(tensor: torch.Tensor) -> PackedTensor | torch.Tensor:
    """A dense CPU tensor -> ``PackedTensor`` (dtypes numpy lacks, e.g. bfloat16, travel as same-size
    ints); device, sparse and quantized tensors and subclasses (``Parameter``, ``DTensor``) are returned
    as they are."""
    if (type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.layout != torch.strided
            or tensor.is_quantized):
        return tensor
    t = tensor.detach().contiguous()
    try:
        array = t.numpy()
    except TypeError:  # bfloat16, float8...: carry the bits
        array = t.view(_SAME_SIZE_INT[t.element_size()]).numpy()
    return PackedTensor(array, str(t.dtype).removeprefix("torch."))


def unpack_tensor(packed: PackedTensor) -> torch.Tensor:
    array = packed.array if packed.array.flags.writeable else packed.array.copy()  # zero-copy buffers are read-only
    tensor = torch.from_numpy(array)
    dtype = getattr(torch, packed.dtype)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


def _map_tree(value: Any, leaf: Any) -> Any:
    """``leaf`` applied to everything inside plain dicts, lists and tuples (rebuilt as the same type)."""
    if type(value) in _MAPPINGS:
        return type(value)((k, _map_tree(v, leaf)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_map_tree(v, leaf) for v in value)
    return leaf(value)


def pack_tree(value: Any) -> Any:
    """Tensors (also inside plain dicts, lists and tuples) -> ``PackedTensor``; anything else as is."""
    return _map_tree(value, lambda v: pack_tensor(v) if isinstance(v, torch.Tensor) else v)


def unpack_tree(value: Any) -> Any:
    """The inverse of ``pack_tree``."""
    return _map_tree(value, lambda v: unpack_tensor(v) if isinstance(v, PackedTensor) else v)


class _Wired:
    __slots__ = ("packed",)

    def __init__(self, packed: Any) -> None:
        self.packed = packed

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return unpack_tree, (self.packed,)


def wire(obj: Any) -> Any:
    """``obj`` ready to pickle with its tensors as numpy arrays; unpickling gives ``obj`` back (tensors
    restored, plain containers rebuilt), so receivers need no extra step."""
    return _Wired(pack_tree(obj))
