"""``FluxBundle``: the modules of one FLUX model, loaded from a local folder or built as a tiny demo."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unirl_ray.models.diffusers_family import DiffusersBundle
from unirl_ray.models.flux.config import FluxPipelineConfig

if TYPE_CHECKING:
    from diffusers import FluxPipeline as DiffusersFluxPipeline

logger = logging.getLogger(__name__)

FROZEN_COMPONENTS = ("vae", "text_encoder", "text_encoder_2")


@dataclass(kw_only=True)
class FluxBundle(DiffusersBundle):
    """All FLUX components. Frozen parts are in eval mode without grads; the transformer is left trainable.

    ``save_pretrained`` writes a ``FluxPipeline`` folder; its transformer loads alone with
    ``FluxTransformer2DModel.from_pretrained(directory, subfolder="transformer")``.
    """

    pipeline_class_name = "FluxPipeline"
    frozen_components = FROZEN_COMPONENTS
    media = "images"

    transformer: torch.nn.Module
    """``FluxTransformer2DModel`` (the train backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    vae: torch.nn.Module
    """``AutoencoderKL`` (frozen; 16 latent channels in FLUX.1)."""
    text_encoder: torch.nn.Module
    """``CLIPTextModel`` (frozen): its pooled output conditions the transformer."""
    text_encoder_2: torch.nn.Module
    """``T5EncoderModel`` (frozen): the token embeddings the transformer attends to."""
    tokenizer: Any
    """CLIP tokenizer of ``text_encoder``."""
    tokenizer_2: Any
    """T5 tokenizer of ``text_encoder_2``."""
    scheduler: Any
    """``FlowMatchEulerDiscreteScheduler`` (only its config is used: the pipeline computes sigmas)."""
    config: FluxPipelineConfig
    """The config this bundle was built from."""
    is_demo: bool
    """True for the tiny randomly initialised demo model."""
    _pipe: DiffusersFluxPipeline | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: FluxPipelineConfig) -> "FluxBundle":
        """Load ``config.pretrained_model_ckpt_path`` (local files only) or build the tiny demo model."""
        from diffusers import FluxPipeline as DiffusersFluxPipeline

        from unirl_ray.models.flux.tiny import build_tiny_flux_pipeline

        if config.is_demo:
            cls._warn_demo(config)
            pipe = build_tiny_flux_pipeline(config.tiny)
            cls._cast([pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2], config.dtype)
        else:
            logger.info("FLUX: loading %s (%s)", config.pretrained_model_ckpt_path, config.torch_dtype)
            pipe = DiffusersFluxPipeline.from_pretrained(config.pretrained_model_ckpt_path, dtype=config.dtype,
                                                         local_files_only=True)
        return cls.from_diffusers(pipe, config=config)
