"""FLUX family (FLUX.1-dev style: guidance-distilled, 2 x 2 packed latents): config, component bundle,
Flow-GRPO sampling pipeline, tiny demo model.

Names are imported lazily: ``from unirl_ray.models.flux import FluxPipelineConfig`` does not import
diffusers / transformers, and neither does importing ``FluxBundle`` or ``FluxPipeline`` (a driver checks a recipe's
targets so): they import them where they build, sample or save; the tiny builder's module imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.flux.bundle import FluxBundle
    from unirl_ray.models.flux.config import FluxPipelineConfig, TinyFluxConfig
    from unirl_ray.models.flux.pipeline import FluxPipeline

_EXPORTS = {
    "FluxBundle": "bundle",
    "FluxPipeline": "pipeline",
    "FluxPipelineConfig": "config",
    "TinyFluxConfig": "config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
