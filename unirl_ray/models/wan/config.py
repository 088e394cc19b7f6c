"""Configuration of the Wan video family (validated on the driver from JSON only, no weights loaded).

Light on purpose: no diffusers / transformers import, so drivers can validate configs cheaply.

Geometry of a Wan video (what ``validate_video`` checks): the causal video VAE keeps the first frame
and compresses the rest ``temporal`` x in time and ``spatial`` x in space, so a clip of ``F`` frames
at ``H x W`` has latents ``[C, (F - 1) / temporal + 1, H / spatial, W / spatial]``; the transformer
then patches them ``(p_t, p_h, p_w)``. Hence ``F - 1`` must be a multiple of ``temporal`` (and the
latent frame count of ``p_t``), ``H`` and ``W`` multiples of ``spatial x p_h`` / ``spatial x p_w``.
Wan2.1: temporal 4, spatial 8, patch (1, 2, 2): 81 or 33 frames at 480 x 832.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from unirl_ray.core.dtypes import TORCH_DTYPES
from unirl_ray.models.diffusers_family import DiffusersFolderConfig, validate_frame_size


@dataclass(kw_only=True)
class TinyWanConfig:
    """Knobs of the tiny demo Wan model (defaults: ~22k transformer params, 5 frames of 16x16)."""

    seed: int = 0
    """Seed of the random weight initialisation (same seed -> identical weights)."""
    num_layers: int = 2
    """Number of ``WanTransformerBlock``s of the transformer."""
    num_attention_heads: int = 2
    """Attention heads of the transformer."""
    attention_head_dim: int = 12
    """Per-head width of the transformer (a multiple of 6: the 3D rotary embedding splits it t/h/w)."""
    ffn_dim: int = 48
    """Feed-forward width of each block."""
    freq_dim: int = 32
    """Sinusoidal timestep embedding width."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    """Transformer patch ``(t, h, w)`` on the latent grid."""
    latent_channels: int = 4
    """VAE latent channels ``z_dim`` (= transformer in/out channels)."""
    vae_base_dim: int = 8
    """Base width of the video VAE."""
    vae_dim_mult: tuple[int, ...] = (1, 2)
    """VAE width multipliers per level; spatial factor = ``2 ** (len - 1)``."""
    vae_temporal_downsample: tuple[bool, ...] = (True,)
    """Which VAE downsampling levels also halve time (``len(vae_dim_mult) - 1`` entries)."""
    text_dim: int = 32
    """Width of the tiny UMT5 text encoder (= transformer ``text_dim``)."""
    scheduler_shift: float = 3.0
    """Timestep shift of the flow-matching schedule (Wan2.1 uses 3.0 at 480p)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.attention_head_dim % 6:
            raise ValueError(
                f"attention_head_dim ({self.attention_head_dim}) must be a multiple of 6: Wan's rotary "
                "embedding splits each head into time / height / width parts"
            )
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must be (t, h, w), got {self.patch_size}")
        if len(self.vae_temporal_downsample) != len(self.vae_dim_mult) - 1:
            raise ValueError(
                f"vae_temporal_downsample needs len(vae_dim_mult) - 1 = {len(self.vae_dim_mult) - 1} entries, "
                f"got {len(self.vae_temporal_downsample)}"
            )

    @property
    def scale_factor_spatial(self) -> int:
        return 2 ** (len(self.vae_dim_mult) - 1)

    @property
    def scale_factor_temporal(self) -> int:
        return 2 ** sum(bool(t) for t in self.vae_temporal_downsample)


@dataclass(frozen=True)
class VideoGeometry:
    """VAE compression and transformer patch of one Wan model (read from config JSON)."""

    temporal: int
    """Frames per latent frame after the first (Wan2.1: 4)."""
    spatial: int
    """Pixels per latent pixel along height and width (Wan2.1: 8)."""
    patch: tuple[int, int, int]
    """Transformer patch ``(t, h, w)`` on the latent grid (Wan2.1: (1, 2, 2))."""
    latent_channels: int
    """VAE latent channels ``z_dim`` (Wan2.1: 16)."""

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of a clip of ``num_frames`` (the first frame is kept, the rest compressed)."""
        return (num_frames - 1) // self.temporal + 1


@dataclass(kw_only=True)
class WanPipelineConfig(DiffusersFolderConfig):
    """Which Wan weights to load and in which dtype."""

    family = "Wan"
    folder_kind = (
        "WanPipeline folder (e.g. Wan2.1-T2V-1.3B-Diffusers: model_index.json, transformer/, vae/, "
        "text_encoder/, tokenizer/, scheduler/)"
    )
    written_by = "diffusers WanPipeline.save_pretrained (or a downloaded *-Diffusers Wan repository)"
    dtype_fields = ("torch_dtype", "vae_torch_dtype")

    vae_torch_dtype: str = "float32"
    """Dtype of the video VAE (Wan decodes in float32: bf16 decoding shows artefacts)."""
    seed: int = 0
    """Seed of the demo model's weights when ``tiny`` is not given (unused for a checkpoint)."""
    tiny: TinyWanConfig | None = None
    """Shape knobs of the demo model; defaults to ``TinyWanConfig(seed=seed)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiny is None:
            self.tiny = TinyWanConfig(seed=self.seed)

    def _check_folder(self, path: str) -> None:
        super()._check_folder(path)
        with open(os.path.join(path, "model_index.json"), encoding="utf-8") as f:
            index = json.load(f)
        if (index.get("transformer_2") or [None])[0] is not None:
            raise ValueError(
                f"{path!r} is a two-expert Wan2.2 checkpoint (transformer_2 is set); only single-transformer "
                "Wan checkpoints (Wan2.1 T2V 1.3B / 14B) are supported"
            )

    @property
    def vae_dtype(self) -> torch.dtype:
        """``vae_torch_dtype`` as a ``torch.dtype``."""
        return TORCH_DTYPES[self.vae_torch_dtype]

    def geometry(self) -> VideoGeometry:
        """VAE factors and transformer patch (tiny config, or the checkpoint's JSON only)."""
        if self.is_demo:
            t = self.tiny
            assert t is not None
            patch = tuple(t.patch_size)
            return VideoGeometry(t.scale_factor_temporal, t.scale_factor_spatial, patch, t.latent_channels)
        vae, transformer = self._component_config("vae"), self._component_config("transformer")
        dim_mult = vae.get("dim_mult", [1, 2, 4, 4])
        down = vae.get("temperal_downsample", [False, True, True])
        temporal = vae.get("scale_factor_temporal") or 2 ** sum(bool(d) for d in down)
        spatial = vae.get("scale_factor_spatial") or 2 ** (len(dim_mult) - 1)
        patch = tuple(int(p) for p in transformer.get("patch_size", (1, 2, 2)))
        return VideoGeometry(int(temporal), int(spatial), patch, int(vae.get("z_dim", 16)))

    def latent_factor(self) -> int:
        """Pixels per transformer token side: ``spatial VAE factor x patch`` (height and width)."""
        g = self.geometry()
        return g.spatial * max(g.patch[1], g.patch[2])

    def validate_video(self, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` (with the nearest valid values) unless the clip fits the VAE and patch sizes."""
        g = self.geometry()
        factor = self.latent_factor()
        validate_frame_size(height, width, factor, f"VAE spatial factor {g.spatial} x patch size of this Wan model")
        t = g.temporal
        if num_frames < 1 or (num_frames - 1) % t or g.latent_frames(num_frames) % g.patch[0]:
            lower = 1 + max(0, num_frames - 1) // t * t
            raise ValueError(
                f"num_frames={num_frames} must be 1 + a multiple of {t} (the VAE keeps the first frame and "
                f"compresses the rest {t}x in time), with a latent frame count divisible by the transformer's time "
                f"patch {g.patch[0]}; e.g. use {lower} or {lower + t}"
            )
