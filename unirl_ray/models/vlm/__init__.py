"""Vision-language models for the AR trainers (Qwen2.5-VL): prompts with images, answers in text.

Config, bundle (the model and its processor), sampling / log-prob pipeline, tiny demo model. Names are imported
lazily: ``from unirl_ray.models.vlm import VLMConfig`` does not import transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.vlm.bundle import VLMBundle
    from unirl_ray.models.vlm.config import TinyVLMConfig, VLMConfig
    from unirl_ray.models.vlm.pipeline import VLMPipeline

_EXPORTS = {
    "VLMBundle": "bundle",
    "VLMPipeline": "pipeline",
    "VLMConfig": "config",
    "TinyVLMConfig": "config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
