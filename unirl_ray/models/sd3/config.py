"""Configuration of the SD3 model family (validated on the driver, no weights loaded).

Light on purpose: no diffusers / transformers import, so drivers can validate configs cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from unirl_ray.core.dtypes import TORCH_DTYPES  # noqa: F401  (re-exported for callers)
from unirl_ray.models.diffusers_family import DiffusersFolderConfig, validate_frame_size


@dataclass(kw_only=True)
class TinySD3Config:
    """Knobs of the tiny demo SD3 model (defaults: ~0.28M transformer params, 32x32 images)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    num_layers: int = 2
    """Number of ``JointTransformerBlock``s of the transformer."""
    num_attention_heads: int = 4
    """Attention heads of the transformer."""
    attention_head_dim: int = 16
    """Per-head width of the transformer (inner width = heads x head_dim)."""
    patch_size: int = 2
    """Transformer patch size on the latent grid."""
    sample_size: int = 32
    """Default image side in pixels (the transformer's latent ``sample_size`` is derived from it)."""
    latent_channels: int = 4
    """VAE latent channels (= transformer in/out channels)."""
    vae_block_out_channels: tuple[int, ...] = (8, 16)
    """VAE block widths; ``vae_scale_factor = 2 ** (len - 1)``."""
    vae_norm_num_groups: int = 1
    """GroupNorm groups of the VAE; 1 keeps latent channel shifts visible in the decoded colours."""
    clip_hidden_size: int = 16
    """Hidden width of each tiny CLIP text encoder."""
    clip_projection_dim: int = 16
    """Projection width of each CLIP encoder (pooled dim = 2x this)."""
    t5_d_model: int = 32
    """T5 width = transformer ``joint_attention_dim`` (must be >= 2 x ``clip_hidden_size``)."""
    clip_max_length: int = 77
    """CLIP tokenizer / position-embedding length."""
    scheduler_shift: float = 3.0
    """Timestep shift of the flow-matching scheduler (SD3 uses 3.0)."""

    def __post_init__(self) -> None:
        if self.t5_d_model < 2 * self.clip_hidden_size:
            raise ValueError(
                f"t5_d_model ({self.t5_d_model}) must be >= 2 x clip_hidden_size ({self.clip_hidden_size}): "
                "the two CLIP embeddings are concatenated and padded to the T5 width"
            )
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.sample_size % self.latent_factor() != 0:
            raise ValueError(
                f"sample_size ({self.sample_size}) must be divisible by vae_scale_factor x patch_size "
                f"({self.latent_factor()})"
            )

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_block_out_channels) - 1)

    def latent_factor(self) -> int:
        """Pixels per transformer token side: ``vae_scale_factor x patch_size``."""
        return self.vae_scale_factor * self.patch_size


@dataclass(kw_only=True)
class SD3PipelineConfig(DiffusersFolderConfig):
    """Which SD3 weights to load and in which dtype."""

    family = "SD3"
    folder_kind = "StableDiffusion3Pipeline folder (with model_index.json, transformer/, vae/, ...)"
    written_by = "StableDiffusion3Pipeline.save_pretrained (or a downloaded diffusers SD3 repository)"

    seed: int = 0
    """Seed of the demo model's weights when ``tiny`` is not given (unused for a checkpoint)."""
    tiny: TinySD3Config | None = None
    """Shape knobs of the demo model; defaults to ``TinySD3Config(seed=seed)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiny is None:
            self.tiny = TinySD3Config(seed=self.seed)

    def latent_factor(self) -> int:
        """Image pixels per transformer token side: ``vae_scale_factor x patch_size`` (JSON only)."""
        if self.is_demo:
            assert self.tiny is not None
            return self.tiny.latent_factor()
        vae = self._component_config("vae")
        transformer = self._component_config("transformer")
        vae_scale = 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1)
        return vae_scale * int(transformer.get("patch_size", 2))

    def validate_resolution(self, height: int, width: int) -> None:
        """Raise ``ValueError`` unless ``height`` and ``width`` are positive multiples of ``latent_factor()``."""
        validate_frame_size(height, width, self.latent_factor(), "vae_scale_factor x patch_size of this SD3 model")
