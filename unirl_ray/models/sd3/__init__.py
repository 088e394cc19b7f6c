"""Stable Diffusion 3 family: config, component bundle, Flow-GRPO sampling pipeline, tiny demo model.

Names are imported lazily: ``from unirl_ray.models.sd3 import SD3PipelineConfig`` does not import
diffusers / transformers, and neither does importing ``SD3Bundle`` or ``SD3Pipeline`` (a driver checks a recipe's
targets so): they import them where they build, sample or save; the tiny builder's module imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.sd3.bundle import SD3Bundle
    from unirl_ray.models.sd3.config import SD3PipelineConfig, TinySD3Config
    from unirl_ray.models.sd3.pipeline import SD3Pipeline

_EXPORTS = {
    "SD3Bundle": "bundle",
    "SD3Pipeline": "pipeline",
    "SD3PipelineConfig": "config",
    "TinySD3Config": "config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
