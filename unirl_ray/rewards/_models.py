"""What the learned rewards share: argument checks, where the model runs, and images as frames.

torch is imported only by ``device_and_dtype`` (called when a reward model is built)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def check_arguments(who: str, path: str | None, tiny: bool, folder: str, **positive: Any) -> None:
    """Exactly one of ``path`` / ``tiny``; every keyword in ``positive`` an int >= 1."""
    if (path is None) == (not tiny):
        raise ValueError(f"{who} needs exactly one of path='{folder}' or tiny=True")
    for name, value in positive.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def device_and_dtype(device: str, dtype: str | None) -> tuple[Any, Any]:
    """``(torch.device, torch.dtype)``: ``"auto"`` is cuda when visible (e.g. with ``ray_actor_options.num_gpus``);
    ``dtype`` names a torch dtype (``"bfloat16"``), None is float32."""
    import torch

    torch_dtype = getattr(torch, dtype, None) if dtype else torch.float32
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype like 'bfloat16', got {dtype!r}")
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device), torch_dtype


def frames_of(image: Any, index: int | None = None) -> np.ndarray:
    """A sample's image as a uint8 ``[F, H, W, 3]`` stack (an image ``[H, W, 3]`` gives F = 1); a clear error for
    anything else (``index``: the sample's place in its batch, named in the message)."""
    where = "" if index is None else f"image {index}: "
    arr = np.asarray(image)
    stack = arr[None] if arr.ndim == 3 else arr
    if stack.ndim != 4 or stack.shape[-1] != 3:
        raise ValueError(f"{where}expected an image [H, W, 3] or frames [F, H, W, 3], got shape {tuple(arr.shape)}; "
                         "decode images to RGB uint8 before scoring")
    if stack.dtype != np.uint8:
        raise ValueError(f"{where}expected uint8 pixels (a uint8 image [H, W, 3] or frames [F, H, W, 3]), got dtype "
                         f"{arr.dtype}; convert with (x * 255).round().astype(np.uint8)")
    if not len(stack):
        raise ValueError(f"{where}a video with no frames, shape {tuple(arr.shape)}")
    return stack


def image_frames(images: Sequence[Any], keep: Sequence[bool] | None = None) -> tuple[list[np.ndarray], list[int]]:
    """Every frame of every sample (``frames_of``), and the sample each frame belongs to; samples whose ``keep``
    is False are checked but give no frames."""
    frames, owner = [], []
    for i, image in enumerate(images):
        stack = frames_of(image, i)
        if keep is None or keep[i]:
            frames.extend(stack)
            owner.extend([i] * len(stack))
    return frames, owner


def mean_per_sample(values: Sequence[float], owner: Sequence[int], n: int) -> list[float]:
    """The mean of each sample's frame values (every sample has at least one frame)."""
    sums = np.bincount(owner, weights=np.asarray(values, dtype=np.float64), minlength=n)
    counts = np.bincount(owner, minlength=n)
    return [float(s / c) for s, c in zip(sums, counts)]
