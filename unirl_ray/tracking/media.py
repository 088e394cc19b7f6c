"""Video media for tracking: animated GIFs and frame strips from uint8 frames ``[F, H, W, 3]``.

``log_videos`` stores, per video, an animated GIF (plays in the MLflow artifact viewer and any
browser) and a PNG strip of its frames side by side (for a glance and for diffing), plus one caption
table per step. Like ``MLflowTracker``'s own calls it never raises: a failing backend sends the files
to the tracker's local fallback folder.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_FPS = 8
"""Playback rate of logged GIFs when the pipeline names none."""


def video_frames(video: Any) -> np.ndarray:
    """``video`` as contiguous uint8 frames ``[F, H, W, 3]`` (float input is read as [0, 1]; one image gives F = 1)."""
    arr = np.asarray(video)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected video frames [F, H, W, 3], got shape {tuple(arr.shape)}")
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    arr = arr[..., :3]
    if arr.dtype != np.uint8:
        arr = np.clip(np.nan_to_num(arr.astype(np.float32)) * 255.0, 0, 255).round().astype(np.uint8)
    return np.ascontiguousarray(arr)


def frame_strip(video: Any, *, gap: int = 1) -> Any:
    """All frames of ``video`` side by side, ``gap`` white pixels apart, as one PIL RGB image."""
    from PIL import Image

    frames = video_frames(video)
    f, h, w, _ = frames.shape
    strip = Image.new("RGB", (f * w + (f - 1) * gap, h), "white")
    for i, frame in enumerate(frames):
        strip.paste(Image.fromarray(frame), (i * (w + gap), 0))
    return strip


def write_gif(video: Any, path: str | Path, *, fps: float = DEFAULT_FPS) -> Path:
    """Write ``video`` as an endlessly looping animated GIF at ``fps``; returns the path.

    GIF stores 256 colours per frame (quantised by PIL) and centisecond frame delays, so playback is
    approximate; identical consecutive frames are merged by the encoder into one longer frame.
    """
    from PIL import Image

    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    frames = [Image.fromarray(f) for f in video_frames(video)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=max(20, round(1000 / fps)),
        loop=0,
        optimize=False,
        disposal=1,
    )
    return path


def write_videos(
    directory: str | Path, videos: Sequence[Any], *, fps: float = DEFAULT_FPS
) -> list[Path]:
    """``{i:02d}.gif`` and ``{i:02d}_strip.png`` per video in ``directory``; returns the files written."""
    directory = Path(directory)
    written: list[Path] = []
    for i, video in enumerate(videos):
        written.append(write_gif(video, directory / f"{i:02d}.gif", fps=fps))
        strip = directory / f"{i:02d}_strip.png"
        frame_strip(video).save(strip)
        written.append(strip)
    return written


def log_videos(
    tracker: Any,
    step: int,
    videos: Sequence[Any],
    captions: Sequence[str],
    *,
    key: str = "samples",
    fps: float = DEFAULT_FPS,
) -> None:
    """Log each video as ``<key>/step_<step>/<i>.gif`` + ``<i>_strip.png`` and the captions as the
    table ``<key>/step_<step>.json`` on an ``MLflowTracker``'s run (or its local fallback folder)."""
    if not videos:
        return
    captions = [str(c) for c in captions][: len(videos)]
    captions += [""] * (len(videos) - len(captions))
    folder = f"{key}/step_{int(step):06d}"
    tmp = Path(tempfile.mkdtemp(prefix="unirl_videos_"))
    try:
        try:
            write_videos(tmp, videos, fps=fps)
        except Exception as exc:  # noqa: BLE001 - bad media must not stop training
            logger.warning("cannot write sample videos at step %d: %s", step, exc)
            return
        tracker.log_artifacts(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = {"step": [int(step)] * len(videos), "index": list(range(len(videos))), "caption": captions}
    tracker.log_table(table, f"{folder}.json")
