"""``SD3Bundle``: the modules of one SD3 model, loaded from a local folder or built as a tiny demo."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline

from unirl_ray.models.sd3.config import SD3PipelineConfig
from unirl_ray.models.sd3.tiny import build_tiny_sd3_pipeline

logger = logging.getLogger(__name__)

FROZEN_COMPONENTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass(kw_only=True)
class SD3Bundle:
    """All SD3 components. Frozen parts are in eval mode without grads; the transformer is left trainable."""

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
        if config.is_demo:
            logger.warning(
                "SD3: no pretrained_model_ckpt_path given; building a TINY RANDOMLY INITIALISED DEMO model "
                "(%s). Its images are noise-like: set pretrained_model_ckpt_path for real training.",
                config.tiny,
            )
            pipe = build_tiny_sd3_pipeline(config.tiny)
            for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
                # plain nn.Module.to: the diffusers override warns about (no) fp32 modules on every cast
                torch.nn.Module.to(module, dtype=config.dtype)
        else:
            logger.info("SD3: loading %s (%s)", config.pretrained_model_ckpt_path, config.torch_dtype)
            pipe = StableDiffusion3Pipeline.from_pretrained(
                config.pretrained_model_ckpt_path, dtype=config.dtype, local_files_only=True
            )
        return cls.from_diffusers(pipe, config=config)

    @classmethod
    def from_diffusers(cls, pipe: StableDiffusion3Pipeline, *, config: SD3PipelineConfig) -> "SD3Bundle":
        """Wrap the components of an existing diffusers pipeline (freezes the non-trained parts)."""
        bundle = cls(
            transformer=pipe.transformer,
            vae=pipe.vae,
            text_encoder=pipe.text_encoder,
            text_encoder_2=pipe.text_encoder_2,
            text_encoder_3=pipe.text_encoder_3,
            tokenizer=pipe.tokenizer,
            tokenizer_2=pipe.tokenizer_2,
            tokenizer_3=pipe.tokenizer_3,
            scheduler=pipe.scheduler,
            config=config,
            is_demo=config.is_demo,
            _pipe=pipe,
        )
        for module in bundle.frozen_modules():
            module.eval()
            module.requires_grad_(False)
        return bundle

    def frozen_modules(self) -> list[torch.nn.Module]:
        """VAE and text encoders (never trained)."""
        mods = [getattr(self, name) for name in FROZEN_COMPONENTS]
        return [m for m in mods if m is not None]

    @property
    def device(self) -> torch.device:
        """Device of the VAE (where prompts are encoded and images decoded)."""
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Weight dtype from the config."""
        return self.config.dtype

    def to(self, device: torch.device | str) -> "SD3Bundle":
        """Move every component (transformer included) to ``device``; returns ``self``."""
        for module in [self.transformer, *self.frozen_modules()]:
            module.to(device)
        return self

    def diffusers_pipeline(self) -> StableDiffusion3Pipeline:
        """A ``StableDiffusion3Pipeline`` over these components (used for prompt encoding)."""
        if self._pipe is None:
            self._pipe = self._new_pipeline()
        return self._pipe

    def _new_pipeline(self) -> StableDiffusion3Pipeline:
        return StableDiffusion3Pipeline(
            transformer=self.transformer,
            scheduler=self.scheduler,
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            text_encoder_2=self.text_encoder_2,
            tokenizer_2=self.tokenizer_2,
            text_encoder_3=self.text_encoder_3,
            tokenizer_3=self.tokenizer_3,
        )

    def save_pretrained(self, directory: str) -> str:
        """Write every component as a diffusers ``StableDiffusion3Pipeline`` folder; returns its ``transformer/``.

        The folder holds ``model_index.json`` and ``transformer/``, ``vae/``, ``text_encoder{,_2,_3}/``,
        ``tokenizer{,_2,_3}/`` and ``scheduler/`` (no ``text_encoder_3`` / ``tokenizer_3`` weights when
        the bundle has no T5). It loads with ``StableDiffusion3Pipeline.from_pretrained(directory)``, its
        transformer alone with ``SD3Transformer2DModel.from_pretrained(directory, subfolder="transformer")``,
        and it is a valid ``pretrained_model_ckpt_path``.
        """
        pipe = self._new_pipeline()  # built anew: the cached pipeline may hold replaced components
        os.makedirs(directory, exist_ok=True)
        pipe.save_pretrained(directory)
        return os.path.join(directory, "transformer")
