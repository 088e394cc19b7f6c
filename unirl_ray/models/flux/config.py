"""Configuration of the FLUX model family (validated on the driver, no weights loaded).

Light on purpose: no diffusers / transformers import, so drivers can validate configs cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from unirl_ray.models.diffusers_family import DiffusersFolderConfig, validate_frame_size

PACK = 2
"""FLUX packs each 2 x 2 patch of latents into one token (``FluxPipeline._pack_latents``)."""


@dataclass(kw_only=True)
class TinyFluxConfig:
    """Knobs of the tiny demo FLUX model (defaults: ~25k transformer params, 32x32 images)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    num_layers: int = 1
    """``FluxTransformerBlock``s (double-stream: text and image apart)."""
    num_single_layers: int = 1
    """``FluxSingleTransformerBlock``s (single-stream: text and image tokens together)."""
    num_attention_heads: int = 2
    """Attention heads of the transformer."""
    attention_head_dim: int = 8
    """Per-head width; the rotary axes ``axes_dims_rope`` split it as (h/4, h/4, h/2)."""
    sample_size: int = 32
    """Default image side in pixels."""
    latent_channels: int = 4
    """VAE latent channels (the transformer sees 4x this per packed token)."""
    vae_block_out_channels: tuple[int, ...] = (8, 16)
    """VAE block widths; ``vae_scale_factor = 2 ** (len - 1)``."""
    clip_hidden_size: int = 16
    """Hidden width of the CLIP text encoder (its pooled output conditions the transformer)."""
    t5_d_model: int = 32
    """T5 width = transformer ``joint_attention_dim``."""
    clip_max_length: int = 77
    """CLIP tokenizer / position-embedding length."""
    guidance_embeds: bool = True
    """FLUX.1-dev's guidance distillation: the transformer takes the guidance scale as an input."""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_single_layers < 0:
            raise ValueError(f"num_layers must be >= 1 and num_single_layers >= 0, got {self.num_layers}, "
                             f"{self.num_single_layers}")
        if self.attention_head_dim % 4:
            raise ValueError(f"attention_head_dim must be a multiple of 4 (the rotary axes), got {self.attention_head_dim}")
        if self.sample_size % self.latent_factor() != 0:
            raise ValueError(f"sample_size ({self.sample_size}) must be divisible by vae_scale_factor x 2 "
                             f"({self.latent_factor()})")

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_block_out_channels) - 1)

    def latent_factor(self) -> int:
        """Pixels per transformer token side: ``vae_scale_factor x 2`` (the 2 x 2 packing)."""
        return self.vae_scale_factor * PACK


@dataclass(kw_only=True)
class FluxPipelineConfig(DiffusersFolderConfig):
    """Which FLUX weights to load and in which dtype."""

    family = "FLUX"
    folder_kind = "FluxPipeline folder (with model_index.json, transformer/, vae/, text_encoder/, text_encoder_2/, ...)"
    written_by = "FluxPipeline.save_pretrained (or a downloaded diffusers FLUX repository, e.g. FLUX.1-dev)"

    seed: int = 0
    """Seed of the demo model's weights when ``tiny`` is not given (unused for a checkpoint)."""
    tiny: TinyFluxConfig | None = None
    """Shape knobs of the demo model; defaults to ``TinyFluxConfig(seed=seed)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiny is None:
            self.tiny = TinyFluxConfig(seed=self.seed)

    def latent_factor(self) -> int:
        """Image pixels per transformer token side: ``vae_scale_factor x 2`` (JSON only)."""
        if self.is_demo:
            assert self.tiny is not None
            return self.tiny.latent_factor()
        vae = self._component_config("vae")
        return 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1) * PACK

    def validate_resolution(self, height: int, width: int) -> None:
        """Raise ``ValueError`` unless ``height`` and ``width`` are positive multiples of ``latent_factor()``."""
        validate_frame_size(height, width, self.latent_factor(), "vae_scale_factor x 2 (the latent packing) of this FLUX model")
