"""Causal-LM family: config, model + tokenizer bundle, sampling pipeline, tiny demo model.

Names are imported lazily: ``from unirl_ray.models.causal_lm import CausalLMConfig`` does not import
transformers, and neither does importing ``CausalLMBundle`` or ``CausalLMPipeline`` (a driver checks a recipe's
targets so): they import it where they build, sample or save; ``build_char_tokenizer`` does when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.causal_lm.bundle import CausalLMBundle
    from unirl_ray.models.causal_lm.config import CausalLMConfig, TinyLMConfig
    from unirl_ray.models.causal_lm.pipeline import CausalLMPipeline
    from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer

_EXPORTS = {
    "CausalLMBundle": "bundle",
    "CausalLMConfig": "config",
    "CausalLMPipeline": "pipeline",
    "TinyLMConfig": "config",
    "build_char_tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
