"""The unified model family: one decoder that writes text and draws images (HunyuanImage-3.0's topology).

A transformers decoder (Qwen2) is the backbone. Text positions take token embeddings and end in the LM
head; image positions take patches of VAE latents (patch embedding + timestep embedding + a 2-D
position embedding) and end in a velocity head, so one backbone carries an AR loss on its text segment
and a flow-matching (Flow-GRPO) loss on its image. The attention mask is a 4-D additive float mask:
causal over text, bidirectional within the image block, the image seeing all of its text.

``UnifiedPipeline`` writes the "think" / recaption segment (``CausalLMPipeline``'s sampler, with
log-probs), then draws the image conditioned on prompt + generated tokens with the flow-SDE sampler and
log-probs of ``unirl_ray.models.flow_sde``; its ``stage_pipelines`` give each stage algorithm its view
(``text`` for GRPO, ``image`` for Flow-GRPO).

Names are imported lazily: ``from unirl_ray.models.unified import UnifiedConfig`` imports no
transformers / diffusers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl_ray._lazy import lazy_getattr

if TYPE_CHECKING:
    from unirl_ray.models.unified.bundle import UnifiedBundle
    from unirl_ray.models.unified.config import TinyUnifiedConfig, UnifiedConfig
    from unirl_ray.models.unified.model import UnifiedTransformer, unified_attention_mask
    from unirl_ray.models.unified.pipeline import UnifiedPipeline

_EXPORTS = {
    "TinyUnifiedConfig": "config",
    "UnifiedBundle": "bundle",
    "UnifiedConfig": "config",
    "UnifiedPipeline": "pipeline",
    "UnifiedTransformer": "model",
    "unified_attention_mask": "model",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
