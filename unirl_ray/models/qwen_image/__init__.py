"""Qwen-Image family (a Qwen2.5-VL text encoder, an MMDiT over 2 x 2 packed latents, a causal video-style VAE
used on single frames): config, component bundle, Flow-GRPO sampling pipeline, tiny demo model.

Names are imported lazily: ``from unirl_ray.models.qwen_image import QwenImagePipelineConfig`` does not import
diffusers / transformers, and neither does importing ``QwenImageBundle`` or ``QwenImagePipeline`` (a driver checks
a recipe's targets so): they import them where they build, sample or save; the tiny builder's module imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.qwen_image.bundle import QwenImageBundle
    from unirl_ray.models.qwen_image.config import QwenImagePipelineConfig, TinyQwenImageConfig
    from unirl_ray.models.qwen_image.pipeline import QwenImagePipeline

_EXPORTS = {
    "QwenImageBundle": "bundle",
    "QwenImagePipeline": "pipeline",
    "QwenImagePipelineConfig": "config",
    "TinyQwenImageConfig": "config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
