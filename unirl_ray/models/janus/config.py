"""Configuration of the Janus-Pro family (validated on the driver, no weights loaded)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from unirl_ray.core.dtypes import TORCH_DTYPES


@dataclass(kw_only=True)
class TinyJanusConfig:
    """Knobs of the tiny randomly initialised demo Janus (a 2-layer Llama, a 3-level VQ model)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    hidden_size: int = 64
    """Backbone width."""
    num_layers: int = 2
    """Decoder layers of the backbone."""
    num_attention_heads: int = 2
    """Attention heads of the backbone."""
    intermediate_size: int = 128
    """Width of the backbone's MLP."""
    max_position_embeddings: int = 256
    """Longest text + image-token sequence."""
    codebook_size: int = 64
    """VQ codebook entries (the image-token vocabulary)."""
    image_tokens_per_side: int = 4
    """Image tokens per image side (tokens per image = its square)."""
    vq_levels: int = 3
    """VQ decoder levels; pixels per token side = 2 ** (levels - 1)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.vq_levels < 1 or self.image_tokens_per_side < 1 or self.codebook_size < 2:
            raise ValueError("num_layers, vq_levels and image_tokens_per_side must be >= 1 and codebook_size >= 2")
        if self.num_attention_heads < 1 or self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")

    @property
    def image_size(self) -> int:
        """Side of a decoded image in pixels."""
        return self.image_tokens_per_side * 2 ** (self.vq_levels - 1)


@dataclass(kw_only=True)
class JanusModelConfig:
    """Which Janus model to load (a transformers ``JanusForConditionalGeneration`` folder) or build (the tiny demo)."""

    pretrained_model_path: str | None = None
    """Local folder with ``config.json`` (``model_type: janus``), weights and tokenizer; None builds the tiny DEMO model."""
    torch_dtype: str = "float32"
    """Dtype of the weights: ``float32``, ``bfloat16`` or ``float16``."""
    tiny: TinyJanusConfig = field(default_factory=TinyJanusConfig)
    """The demo model's shape (unused for a folder)."""

    def __post_init__(self) -> None:
        if isinstance(self.tiny, dict):
            self.tiny = TinyJanusConfig(**self.tiny)
        if self.torch_dtype not in TORCH_DTYPES:
            raise ValueError(f"bundle.config.torch_dtype must be one of {sorted(TORCH_DTYPES)}, got {self.torch_dtype!r}")
        if self.pretrained_model_path is not None:
            path = os.path.expanduser(self.pretrained_model_path)
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ValueError(f"bundle.config.pretrained_model_path={self.pretrained_model_path!r} has no config.json: "
                                 "give a local Janus-Pro folder in transformers format (e.g. a download of "
                                 "deepseek-community/Janus-Pro-1B)")

    @property
    def is_demo(self) -> bool:
        return self.pretrained_model_path is None

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.torch_dtype]
