"""Janus-Pro (transformers' ``JanusForConditionalGeneration``): a unified model whose images are discrete tokens.

One Llama backbone writes the think / recaption segment with its LM head, then the image as VQ codebook
tokens through the generation embeddings and the generation head; the VQ decoder turns the tokens into
pixels. Both segments are token sequences, so both stages train with the GRPO family in one optimizer
step (T2I-R1's setup): ``JanusPipeline.stage_pipelines`` gives the text stage a ``CausalLMPipeline`` and
the image stage ``JanusImageTokens`` (the same ``collate`` / ``token_log_probs`` contract over the image
tokens). Every Part is a ``TextPart``; the stage names (``text``, ``image``) route them.

Loads a local Janus-Pro folder (``deepseek-community/Janus-Pro-1B`` / ``-7B`` in transformers format) or
builds a tiny random model from config. Names are imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.janus.bundle import JanusBundle, JanusPolicy
    from unirl_ray.models.janus.config import JanusModelConfig, TinyJanusConfig
    from unirl_ray.models.janus.pipeline import JanusImageTokens, JanusPipeline

_EXPORTS = {
    "JanusBundle": "bundle",
    "JanusImageTokens": "pipeline",
    "JanusModelConfig": "config",
    "JanusPipeline": "pipeline",
    "JanusPolicy": "bundle",
    "TinyJanusConfig": "config",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
