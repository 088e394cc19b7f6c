"""Configuration of the unified model family (validated on the driver, no weights loaded)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from unirl_ray.config.checks import check_literal_fields
from unirl_ray.core.dtypes import TORCH_DTYPES

TRANSFORMER_DIR = "transformer"
"""Sub-folder of a unified model folder that holds the backbone + image heads (``UnifiedTransformer``)."""
UNIFIED_CONFIG = "unified_config.json"
"""File (in ``transformer/``) with the image-side shape of the model."""


@dataclass(kw_only=True)
class TinyUnifiedConfig:
    """Knobs of the tiny randomly initialised demo model (a 2-layer Qwen2 backbone, a 2-level VAE)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    hidden_size: int = 64
    """Backbone width (= num_attention_heads x head_dim)."""
    num_layers: int = 2
    """Decoder layers of the backbone."""
    num_attention_heads: int = 2
    """Attention heads of the backbone."""
    intermediate_size: int = 128
    """Width of the backbone's MLP."""
    max_position_embeddings: int = 256
    """Longest text + image sequence (RoPE table size)."""
    latent_channels: int = 4
    """VAE latent channels."""
    patch_size: int = 2
    """Latent pixels per image token side."""
    vae_block_out_channels: tuple[int, ...] = (8, 16)
    """VAE block widths; ``vae_scale_factor = 2 ** (len - 1)``."""
    vae_norm_num_groups: int = 1
    """GroupNorm groups of the VAE."""
    scheduler_shift: float = 3.0
    """Timestep shift of the flow-matching scheduler."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.num_attention_heads < 1 or self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads})")
        if self.hidden_size % 4:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of 4 (2-D sin-cos positions)")

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_block_out_channels) - 1)


@dataclass(kw_only=True)
class UnifiedConfig:
    """Which unified model to load (a folder ``UnifiedBundle.save_pretrained`` wrote) or build (the tiny demo)."""

    pretrained_model_path: str | None = None
    """Local folder with ``transformer/``, ``vae/``, ``scheduler/``, ``tokenizer/``; None builds the tiny DEMO model."""
    torch_dtype: str = "float32"
    """Dtype of the weights: ``float32``, ``bfloat16`` or ``float16``."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel of the backbone; both take the 4-D float mask (a test holds them equal)."""
    tiny: TinyUnifiedConfig = field(default_factory=TinyUnifiedConfig)
    """The demo model's shape (unused for a folder)."""

    def __post_init__(self) -> None:
        if isinstance(self.tiny, dict):
            self.tiny = TinyUnifiedConfig(**self.tiny)
        if self.torch_dtype not in TORCH_DTYPES:
            raise ValueError(f"bundle.config.torch_dtype must be one of {sorted(TORCH_DTYPES)}, got {self.torch_dtype!r}")
        check_literal_fields(self, "bundle.config")
        if self.pretrained_model_path is not None:
            path = os.path.expanduser(self.pretrained_model_path)
            if not os.path.isfile(os.path.join(path, TRANSFORMER_DIR, UNIFIED_CONFIG)):
                raise ValueError(f"bundle.config.pretrained_model_path={self.pretrained_model_path!r} is not a unified "
                                 f"model folder (no {TRANSFORMER_DIR}/{UNIFIED_CONFIG}); it is what "
                                 "UnifiedBundle.save_pretrained or an export of a unified run writes")

    @property
    def is_demo(self) -> bool:
        return self.pretrained_model_path is None

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.torch_dtype]

    def image_shape(self) -> dict[str, int]:
        """``latent_channels``, ``patch_size`` and ``vae_scale_factor`` (read from the folder when loading one)."""
        if self.is_demo:
            t = self.tiny
            return {"latent_channels": t.latent_channels, "patch_size": t.patch_size,
                    "vae_scale_factor": t.vae_scale_factor}
        with open(os.path.join(os.path.expanduser(self.pretrained_model_path), TRANSFORMER_DIR, UNIFIED_CONFIG)) as f:
            saved = json.load(f)
        return {k: int(saved[k]) for k in ("latent_channels", "patch_size", "vae_scale_factor")}

    def latent_factor(self) -> int:
        """Pixels per image token side: ``vae_scale_factor x patch_size`` (the driver's resolution check)."""
        shape = self.image_shape()
        return shape["vae_scale_factor"] * shape["patch_size"]
