"""``WanBundle``: the modules of one Wan text-to-video model, loaded from a local folder or built as a tiny demo."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import AutoencoderKLWan
from diffusers import WanPipeline as DiffusersWanPipeline

from unirl_ray.models.wan.config import WanPipelineConfig
from unirl_ray.models.wan.tiny import build_tiny_wan_pipeline

logger = logging.getLogger(__name__)

FROZEN_COMPONENTS = ("vae", "text_encoder")


@dataclass(kw_only=True)
class WanBundle:
    """All Wan components. Frozen parts are in eval mode without grads; the transformer is left trainable."""

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
        if config.is_demo:
            logger.warning(
                "Wan: no pretrained_model_ckpt_path given; building a TINY RANDOMLY INITIALISED DEMO model "
                "(%s). Its videos are noise-like: set pretrained_model_ckpt_path for real training.",
                config.tiny,
            )
            pipe = build_tiny_wan_pipeline(config.tiny)
            for module in (pipe.transformer, pipe.text_encoder):
                # plain nn.Module.to: the diffusers override warns about (no) fp32 modules on every cast
                torch.nn.Module.to(module, dtype=config.dtype)
            torch.nn.Module.to(pipe.vae, dtype=config.vae_dtype)
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
        bundle = cls(
            transformer=pipe.transformer,
            vae=pipe.vae,
            text_encoder=pipe.text_encoder,
            tokenizer=pipe.tokenizer,
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
        """VAE and text encoder (never trained)."""
        return [getattr(self, name) for name in FROZEN_COMPONENTS]

    @property
    def device(self) -> torch.device:
        """Device of the VAE (where prompts are encoded and videos decoded)."""
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Transformer / text encoder dtype from the config."""
        return self.config.dtype

    def to(self, device: torch.device | str) -> "WanBundle":
        """Move every component (transformer included) to ``device``; returns ``self``."""
        for module in [self.transformer, *self.frozen_modules()]:
            module.to(device)
        return self

    def diffusers_pipeline(self) -> DiffusersWanPipeline:
        """A diffusers ``WanPipeline`` over these components (used for prompt encoding)."""
        if self._pipe is None:
            self._pipe = self._new_pipeline()
        return self._pipe

    def _new_pipeline(self) -> DiffusersWanPipeline:
        return DiffusersWanPipeline(
            tokenizer=self.tokenizer,
            text_encoder=self.text_encoder,
            vae=self.vae,
            scheduler=self.scheduler,
            transformer=self.transformer,
        )

    def save_pretrained(self, directory: str) -> str:
        """Write every component as a diffusers ``WanPipeline`` folder; returns its ``transformer/``.

        It loads with ``diffusers.WanPipeline.from_pretrained(directory)``, its transformer alone with
        ``WanTransformer3DModel.from_pretrained(directory, subfolder="transformer")``, and it is a
        valid ``pretrained_model_ckpt_path``.
        """
        pipe = self._new_pipeline()  # built anew: the cached pipeline may hold replaced components
        os.makedirs(directory, exist_ok=True)
        pipe.save_pretrained(directory)
        return os.path.join(directory, "transformer")
