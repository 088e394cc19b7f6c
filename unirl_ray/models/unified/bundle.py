"""``UnifiedBundle``: the unified backbone (trainable), its VAE and scheduler (frozen) and its tokenizer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from unirl_ray.models.unified.config import TRANSFORMER_DIR, TinyUnifiedConfig, UnifiedConfig
from unirl_ray.models.unified.model import UnifiedTransformer

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

logger = logging.getLogger(__name__)


def build_tiny_unified(tiny: TinyUnifiedConfig, tokenizer: Any, attn_implementation: str = "sdpa") -> UnifiedTransformer:
    """A randomly initialised tiny ``UnifiedTransformer`` (weights depend only on ``tiny.seed``; the global RNG
    is left untouched)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_attention_heads, num_key_value_heads=tiny.num_attention_heads,
        intermediate_size=tiny.intermediate_size, max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = attn_implementation  # noqa: SLF001 - transformers' own switch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        module = UnifiedTransformer(lm, latent_channels=tiny.latent_channels, patch_size=tiny.patch_size,
                                    vae_scale_factor=tiny.vae_scale_factor)
    lm.generation_config.pad_token_id = tokenizer.pad_token_id
    lm.generation_config.eos_token_id = tokenizer.eos_token_id
    return module


def build_tiny_vae(tiny: TinyUnifiedConfig) -> AutoencoderKL:
    from diffusers import AutoencoderKL

    n = len(tiny.vae_block_out_channels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed + 1)
        return AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(tiny.vae_block_out_channels),
            layers_per_block=1, latent_channels=tiny.latent_channels, norm_num_groups=tiny.vae_norm_num_groups,
            scaling_factor=1.5, shift_factor=0.05,
        )


@dataclass(kw_only=True)
class UnifiedBundle:
    """The unified model's components; ``transformer`` is what the backend trains (``trainable_attr``)."""

    transformer: UnifiedTransformer
    """Backbone + image heads (trainable; the backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    vae: AutoencoderKL
    """Frozen VAE: latents in and out of the image block."""
    scheduler: FlowMatchEulerDiscreteScheduler
    """Flow-matching schedule of the image steps (its sigmas)."""
    tokenizer: Any
    """Hugging Face tokenizer with a pad and an EOS token."""
    config: UnifiedConfig
    """The config this bundle was built from."""
    is_demo: bool
    """True for the tiny randomly initialised demo model."""

    @classmethod
    def from_config(cls, config: UnifiedConfig) -> "UnifiedBundle":
        """Load ``config.pretrained_model_path`` (local files only) or build the tiny demo model."""
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

        attn = config.attn_implementation
        if config.is_demo:
            from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer

            logger.warning("Unified: no pretrained_model_path given; building a TINY RANDOMLY INITIALISED DEMO model "
                           "(%s) with a char-level tokenizer: set pretrained_model_path for real training", config.tiny)
            tokenizer = build_char_tokenizer()
            transformer = build_tiny_unified(config.tiny, tokenizer, attn)
            vae = build_tiny_vae(config.tiny)
            scheduler = FlowMatchEulerDiscreteScheduler(shift=config.tiny.scheduler_shift)
        else:
            from transformers import PreTrainedTokenizerFast

            path = os.path.expanduser(config.pretrained_model_path)
            transformer = UnifiedTransformer.from_pretrained(os.path.join(path, TRANSFORMER_DIR), dtype=config.dtype,
                                                             attn_implementation=attn)
            vae = AutoencoderKL.from_pretrained(os.path.join(path, "vae"), local_files_only=True)
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(path, "scheduler"))
            tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(path, "tokenizer"))
        transformer = transformer.to(config.dtype).eval()
        vae.requires_grad_(False)
        vae.eval()
        return cls(transformer=transformer, vae=vae, scheduler=scheduler, tokenizer=tokenizer, config=config,
                   is_demo=config.is_demo)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    def frozen_modules(self) -> list[torch.nn.Module]:
        return [self.vae]

    def to(self, device: torch.device | str) -> "UnifiedBundle":
        self.transformer.to(device)
        self.vae.to(device)
        return self

    def save_pretrained(self, directory: str) -> str:
        """``transformer/`` (``UnifiedTransformer.from_pretrained``), ``vae/``, ``scheduler/``, ``tokenizer/``;
        ``UnifiedConfig(pretrained_model_path=directory)`` loads the folder. Returns the transformer's folder
        (the export hook of ``unirl_ray.train.export``)."""
        os.makedirs(directory, exist_ok=True)
        model_dir = self.transformer.save_pretrained(os.path.join(directory, TRANSFORMER_DIR))
        self.vae.save_pretrained(os.path.join(directory, "vae"))
        self.scheduler.save_pretrained(os.path.join(directory, "scheduler"))
        self.tokenizer.save_pretrained(os.path.join(directory, "tokenizer"))
        return model_dir
