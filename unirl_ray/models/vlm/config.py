"""Configuration of the vision-language family (validated on the driver, no weights loaded).

Light on purpose: no transformers import, so drivers can validate configs cheaply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from unirl_ray.models.causal_lm.config import CausalLMConfig


@dataclass(kw_only=True)
class TinyVLMConfig:
    """Knobs of the tiny demo Qwen2.5-VL (a randomly initialised model with a character-level tokenizer; defaults:
    ~60k parameters, images resized to 16 x 16 pixels: 4 image tokens each)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    hidden_size: int = 32
    """Width of the language model (a multiple of 16: 2 heads whose rotary sections split a multiple of 8)."""
    num_layers: int = 2
    """Decoder layers of the language model."""
    vision_hidden_size: int = 16
    """Width of the vision tower."""
    vision_depth: int = 1
    """Blocks of the vision tower."""
    patch_size: int = 4
    """Vision patch side in pixels (the processor's and the tower's); 2 x 2 patches merge into one image token."""
    image_size: int = 16
    """Every image is resized to about this many pixels a side (the processor's min / max pixels)."""
    max_position_embeddings: int = 512
    """Longest prompt + completion."""

    def __post_init__(self) -> None:
        if self.hidden_size % 16 or self.hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive multiple of 16, got {self.hidden_size}")
        if self.image_size % (2 * self.patch_size):
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of 2 x patch_size ({2 * self.patch_size})")


@dataclass(kw_only=True)
class VLMConfig(CausalLMConfig):
    """Which vision-language model to load, in which dtype, and whether its vision tower trains."""

    pretrained_model_path: str | None = None
    """Local Hugging Face Qwen2.5-VL folder (config.json, weights, tokenizer and processor files); ``None`` builds
    the tiny DEMO model."""
    tiny: TinyVLMConfig | None = None
    """Shape knobs of the demo model; defaults to ``TinyVLMConfig(seed=seed)``."""
    freeze_vision: bool = True
    """Keep the vision tower (and its merger) frozen: only the language model trains (with LoRA, only its
    adapters). ``false`` trains the tower too."""
    min_pixels: int | None = None
    """Smallest image area the processor resizes to (None: the processor's own)."""
    max_pixels: int | None = None
    """Largest image area the processor resizes to (None: the processor's own; Qwen2.5-VL's default allows
    ~12.8M pixels, so a recipe usually sets it, e.g. 401408 = 512 x 28 x 28)."""

    def __post_init__(self) -> None:
        if self.tiny is None:
            self.tiny = TinyVLMConfig(seed=self.seed)
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or null, got {value}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        path = self.pretrained_model_path
        if path is not None:
            if not os.path.isdir(path):
                raise ValueError(f"pretrained_model_path {path!r} does not exist or is not a folder; expected a local "
                                 "Qwen2.5-VL folder (config.json, weights, tokenizer and processor files), or leave it "
                                 "unset (null) to use the tiny demo model")
            for name in ("config.json", "preprocessor_config.json"):
                if not os.path.isfile(os.path.join(path, name)):
                    raise ValueError(f"pretrained_model_path {path!r} has no {name}; expected a folder written by "
                                     "save_pretrained (model and processor) or a downloaded Qwen2.5-VL repository")
        super().__post_init__()  # the dtype
