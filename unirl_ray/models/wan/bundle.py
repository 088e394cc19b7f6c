"""``WanBundle``: the modules of one Wan text-to-video model, loaded from a local folder or built as a tiny demo."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unirl_ray.models.diffusers_family import DiffusersBundle
from unirl_ray.models.wan.config import WanPipelineConfig

if TYPE_CHECKING:
    from diffusers import WanPipeline as DiffusersWanPipeline

logger = logging.getLogger(__name__)

FROZEN_COMPONENTS = ("vae", "text_encoder")


@dataclass(kw_only=True)
class WanBundle(DiffusersBundle):
    """All Wan components. Frozen parts are in eval mode without grads; the transformer is left trainable.

    ``save_pretrained`` writes a diffusers ``WanPipeline`` folder; its transformer loads alone with
    ``WanTransformer3DModel.from_pretrained(directory, subfolder="transformer")``.
    """

    pipeline_class_name = "WanPipeline"
    frozen_components = FROZEN_COMPONENTS
    media = "videos"

    transformer: torch.nn.Module
    """``WanTransformer3DModel`` (the train backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    vae: torch.nn.Module
    """``AutoencoderKLWan`` causal video VAE (frozen)."""
    text_encoder: torch.nn.Module
    """``UMT5EncoderModel`` (frozen)."""
    tokenizer: Any
    """T5 / UMT5 tokenizer of ``text_encoder``."""
    scheduler: Any
    """The checkpoint's scheduler (only its config is read: the pipeline computes flow-matching sigmas)."""
    config: WanPipelineConfig
    """The config this bundle was built from."""
    is_demo: bool
    """True for the tiny randomly initialised demo model."""
    _pipe: DiffusersWanPipeline | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: WanPipelineConfig) -> "WanBundle":
        """Load ``config.pretrained_model_ckpt_path`` (local files only) or build the tiny demo model."""
        from diffusers import AutoencoderKLWan
        from diffusers import WanPipeline as DiffusersWanPipeline

        from unirl_ray.models.wan.tiny import build_tiny_wan_pipeline

        if config.is_demo:
            cls._warn_demo(config)
            pipe = build_tiny_wan_pipeline(config.tiny)
            cls._cast([pipe.transformer, pipe.text_encoder], config.dtype)
            cls._cast([pipe.vae], config.vae_dtype)
        else:
            path = config.pretrained_model_ckpt_path
            logger.info("Wan: loading %s (%s, VAE %s)", path, config.torch_dtype, config.vae_torch_dtype)
            vae = AutoencoderKLWan.from_pretrained(path, subfolder="vae", dtype=config.vae_dtype, local_files_only=True)
            pipe = DiffusersWanPipeline.from_pretrained(path, vae=vae, dtype=config.dtype, local_files_only=True)
        return cls.from_diffusers(pipe, config=config)

    @classmethod
    def from_diffusers(cls, pipe: DiffusersWanPipeline, *, config: WanPipelineConfig) -> "WanBundle":
        """Wrap the components of an existing diffusers pipeline (freezes the non-trained parts)."""
        if pipe.transformer is None:
            raise ValueError("the Wan pipeline has no transformer; this family trains a single-transformer Wan model")
        return super().from_diffusers(pipe, config=config)
