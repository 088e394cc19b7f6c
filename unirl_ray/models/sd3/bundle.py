"""``SD3Bundle``: the modules of one SD3 model, loaded from a local folder or built as a tiny demo."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unirl_ray.models.diffusers_family import DiffusersBundle
from unirl_ray.models.sd3.config import SD3PipelineConfig

if TYPE_CHECKING:
    from diffusers import StableDiffusion3Pipeline

logger = logging.getLogger(__name__)

FROZEN_COMPONENTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass(kw_only=True)
class SD3Bundle(DiffusersBundle):
    """All SD3 components. Frozen parts are in eval mode without grads; the transformer is left trainable.

    ``save_pretrained`` writes a ``StableDiffusion3Pipeline`` folder (without ``text_encoder_3`` /
    ``tokenizer_3`` weights when the bundle has no T5); its transformer loads alone with
    ``SD3Transformer2DModel.from_pretrained(directory, subfolder="transformer")``.
    """

    pipeline_class_name = "StableDiffusion3Pipeline"
    frozen_components = FROZEN_COMPONENTS
    media = "images"

    transformer: torch.nn.Module
    """``SD3Transformer2DModel`` (the train backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    vae: torch.nn.Module
    """``AutoencoderKL`` (frozen)."""
    text_encoder: torch.nn.Module
    """First ``CLIPTextModelWithProjection`` (frozen)."""
    text_encoder_2: torch.nn.Module
    """Second ``CLIPTextModelWithProjection`` (frozen)."""
    text_encoder_3: torch.nn.Module | None
    """``T5EncoderModel`` (frozen); ``None`` when the checkpoint ships without T5 (zeros are used)."""
    tokenizer: Any
    """CLIP tokenizer of ``text_encoder``."""
    tokenizer_2: Any
    """CLIP tokenizer of ``text_encoder_2``."""
    tokenizer_3: Any
    """T5 tokenizer of ``text_encoder_3``."""
    scheduler: Any
    """``FlowMatchEulerDiscreteScheduler`` (only its config is used: the pipeline computes sigmas)."""
    config: SD3PipelineConfig
    """The config this bundle was built from."""
    is_demo: bool
    """True for the tiny randomly initialised demo model."""
    _pipe: StableDiffusion3Pipeline | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: SD3PipelineConfig) -> "SD3Bundle":
        """Load ``config.pretrained_model_ckpt_path`` (local files only) or build the tiny demo model."""
        from diffusers import StableDiffusion3Pipeline

        from unirl_ray.models.sd3.tiny import build_tiny_sd3_pipeline

        if config.is_demo:
            cls._warn_demo(config)
            pipe = build_tiny_sd3_pipeline(config.tiny)
            modules = [pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
            cls._cast(modules, config.dtype)
        else:
            logger.info("SD3: loading %s (%s)", config.pretrained_model_ckpt_path, config.torch_dtype)
            pipe = StableDiffusion3Pipeline.from_pretrained(
                config.pretrained_model_ckpt_path, dtype=config.dtype, local_files_only=True
            )
        return cls.from_diffusers(pipe, config=config)
