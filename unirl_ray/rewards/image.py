"""Rule rewards on images and videos.

Every function here follows the TRL-style reward contract::

    fn(*, images: list[np.ndarray], prompts: list[str], **columns) -> list[float | None]

``images[i]`` is a uint8 array ``[H, W, 3]`` (an image) or ``[F, H, W, 3]`` (video frames; the score
is the mean over frames). ``columns`` holds the extra dataset columns, one list per column, aligned
with ``prompts``; rule rewards ignore them. Extra keyword arguments given in a reward recipe
(``kwargs: {rgb: [0, 0, 255]}``) are passed through as keywords, see ``target_color``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from unirl_ray.rewards._models import frames_of

JPEG_QUALITY = 95
"""DDPO's JPEG quality for the compressibility rewards."""


def _per_image(images: Sequence[Any], frame_score: Callable[[np.ndarray], float]) -> list[float]:
    """Apply ``frame_score`` to every frame of every image and average over frames."""
    return [float(np.mean([frame_score(f) for f in frames_of(img)])) for img in images]


def _jpeg_kb(frame: np.ndarray) -> float:
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.tell() / 1000.0


def jpeg_compressibility(*, images: Sequence[Any], prompts: Sequence[str], **columns: Any) -> list[float]:
    """DDPO's compressibility: minus the JPEG size in kB at quality 95 (higher = simpler image)."""
    return [-s for s in _per_image(images, _jpeg_kb)]


def jpeg_incompressibility(*, images: Sequence[Any], prompts: Sequence[str], **columns: Any) -> list[float]:
    """DDPO's incompressibility: the JPEG size in kB at quality 95 (higher = more detail)."""
    return _per_image(images, _jpeg_kb)


def brightness(*, images: Sequence[Any], prompts: Sequence[str], **columns: Any) -> list[float]:
    """Mean pixel value / 255, in [0, 1]. Moves within a few epochs on CPU: the demo reward."""
    return _per_image(images, lambda f: float(f.mean(dtype=np.float64)) / 255.0)


_MAX_RGB_DIST = float(np.sqrt(3.0) * 255.0)


def target_color(
    *,
    images: Sequence[Any],
    prompts: Sequence[str],
    rgb: Sequence[float] = (255, 0, 0),
    **columns: Any,
) -> list[float]:
    """Closeness of every pixel to the colour ``rgb``: 1 - mean Euclidean RGB distance / max, in [0, 1].

    1 means every pixel is exactly ``rgb``. Choose the colour from a recipe with
    ``kwargs: {rgb: [0, 0, 255]}`` or in code with ``make_target_color((0, 0, 255))``.
    """
    target = _check_rgb(rgb)

    def score(frame: np.ndarray) -> float:
        dist = np.linalg.norm(frame.reshape(-1, 3).astype(np.float32) - target, axis=1)
        return 1.0 - float(dist.mean()) / _MAX_RGB_DIST

    return _per_image(images, score)


def make_target_color(rgb: Sequence[float]) -> Callable[..., list[float]]:
    """A ``target_color`` reward bound to one colour (for code that wants a plain reward fn)."""
    target = tuple(float(c) for c in _check_rgb(rgb))

    def target_color_reward(*, images: Sequence[Any], prompts: Sequence[str], **columns: Any) -> list[float]:
        return target_color(images=images, prompts=prompts, rgb=target)

    target_color_reward.__name__ = f"target_color_{'_'.join(str(int(c)) for c in target)}"
    return target_color_reward


def _check_rgb(rgb: Sequence[float]) -> np.ndarray:
    arr = np.asarray(rgb, dtype=np.float32)
    if arr.shape != (3,) or not np.all(np.isfinite(arr)) or arr.min() < 0 or arr.max() > 255:
        raise ValueError(f"rgb must be three numbers in [0, 255], e.g. [255, 0, 0]; got {rgb!r}")
    return arr
