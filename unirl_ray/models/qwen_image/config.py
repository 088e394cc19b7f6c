"""Configuration of the Qwen-Image family (validated on the driver, no weights loaded).

Light on purpose: no diffusers / transformers import, so drivers can validate configs cheaply.

Geometry: the VAE (``AutoencoderKLQwenImage``, Wan's causal VAE on one frame) compresses an image
``2 ** len(temperal_downsample)`` x in space (8 x in Qwen-Image) and the transformer packs each 2 x 2 patch of
latents into one token, so height and width are multiples of ``vae_scale_factor x 2`` (16).
"""

from __future__ import annotations

from dataclasses import dataclass

from unirl_ray.models.diffusers_family import DiffusersFolderConfig, validate_frame_size

PACK = 2
"""Qwen-Image packs each 2 x 2 patch of latents into one token (``QwenImagePipeline._pack_latents``)."""


@dataclass(kw_only=True)
class TinyQwenImageConfig:
    """Knobs of the tiny demo Qwen-Image model (defaults: ~10k transformer params, 32x32 images)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    num_layers: int = 1
    """``QwenImageTransformerBlock``s (dual-stream: text and image with joint attention)."""
    num_attention_heads: int = 2
    """Attention heads of the transformer."""
    attention_head_dim: int = 8
    """Per-head width; the rotary axes ``axes_dims_rope`` split it as (h/4, h/4, h/2)."""
    sample_size: int = 32
    """Default image side in pixels."""
    latent_channels: int = 4
    """VAE latent channels ``z_dim`` (the transformer sees 4x this per packed token)."""
    vae_base_dim: int = 8
    """Base width of the VAE."""
    vae_levels: int = 2
    """VAE downsampling levels: spatial factor ``2 ** vae_levels``."""
    text_hidden_size: int = 32
    """Width of the tiny Qwen2.5-VL text encoder = transformer ``joint_attention_dim``."""
    text_layers: int = 2
    """Decoder layers of the tiny text encoder (its last hidden state conditions the transformer)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.vae_levels < 1 or self.text_layers < 1:
            raise ValueError(f"num_layers, vae_levels and text_layers must be >= 1, got {self.num_layers}, "
                             f"{self.vae_levels}, {self.text_layers}")
        if self.attention_head_dim % 4:
            raise ValueError(f"attention_head_dim must be a multiple of 4 (the rotary axes), got {self.attention_head_dim}")
        if self.text_hidden_size % 16:
            raise ValueError(f"text_hidden_size must be a multiple of 16 (2 heads of a multiple of 8: the text rotary "
                             f"sections), got {self.text_hidden_size}")
        if self.sample_size % self.latent_factor() != 0:
            raise ValueError(f"sample_size ({self.sample_size}) must be divisible by vae_scale_factor x 2 "
                             f"({self.latent_factor()})")

    @property
    def vae_scale_factor(self) -> int:
        return 2**self.vae_levels

    def latent_factor(self) -> int:
        """Pixels per transformer token side: ``vae_scale_factor x 2`` (the 2 x 2 packing)."""
        return self.vae_scale_factor * PACK


@dataclass(kw_only=True)
class QwenImagePipelineConfig(DiffusersFolderConfig):
    """Which Qwen-Image weights to load and in which dtype."""

    family = "Qwen-Image"
    folder_kind = "QwenImagePipeline folder (with model_index.json, transformer/, vae/, text_encoder/, tokenizer/, ...)"
    written_by = "QwenImagePipeline.save_pretrained (or a downloaded diffusers Qwen-Image repository, e.g. Qwen/Qwen-Image)"

    seed: int = 0
    """Seed of the demo model's weights when ``tiny`` is not given (unused for a checkpoint)."""
    tiny: TinyQwenImageConfig | None = None
    """Shape knobs of the demo model; defaults to ``TinyQwenImageConfig(seed=seed)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiny is None:
            self.tiny = TinyQwenImageConfig(seed=self.seed)

    def latent_factor(self) -> int:
        """Image pixels per transformer token side: ``vae_scale_factor x 2`` (JSON only)."""
        if self.is_demo:
            assert self.tiny is not None
            return self.tiny.latent_factor()
        vae = self._component_config("vae")
        return 2 ** len(vae.get("temperal_downsample", [False, True, True])) * PACK

    def validate_resolution(self, height: int, width: int) -> None:
        """Raise ``ValueError`` unless ``height`` and ``width`` are positive multiples of ``latent_factor()``."""
        validate_frame_size(height, width, self.latent_factor(),
                            "vae_scale_factor x 2 (the latent packing) of this Qwen-Image model")
