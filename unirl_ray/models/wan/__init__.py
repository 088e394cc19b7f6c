"""Wan (2.1-style) text-to-video family: config, component bundle, Flow-GRPO sampling pipeline, tiny demo model.

Names are imported lazily: ``from unirl_ray.models.wan import WanPipelineConfig`` does not import
diffusers / transformers, and neither does importing ``WanBundle`` or ``WanPipeline`` (a driver checks a recipe's
targets so): they import them where they build, sample or save; the tiny builder's module imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.wan.bundle import WanBundle
    from unirl_ray.models.wan.config import TinyWanConfig, WanPipelineConfig
    from unirl_ray.models.wan.pipeline import WanPipeline

_EXPORTS = {
    "TinyWanConfig": "config",
    "WanBundle": "bundle",
    "WanPipeline": "pipeline",
    "WanPipelineConfig": "config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
