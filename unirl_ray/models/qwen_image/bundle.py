"""``QwenImageBundle``: the modules of one Qwen-Image model, loaded from a local folder or built as a tiny demo."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from unirl_ray.models.diffusers_family import DiffusersBundle
from unirl_ray.models.qwen_image.config import QwenImagePipelineConfig

if TYPE_CHECKING:
    from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline

logger = logging.getLogger(__name__)

FROZEN_COMPONENTS = ("vae", "text_encoder")


def template_prefix_tokens(pipe: Any) -> int:
    """Tokens of the prompt template before the user's text (the system turn and ``<|im_start|>user\\n``), which
    ``encode_prompt`` drops from the text encoder's output. Diffusers' constant (34) counts them for Qwen's own
    tokenizer and is kept for it; another tokenizer (the demo's character-level one) gets its own count."""
    if type(pipe.tokenizer).__name__.startswith("Qwen2Tokenizer"):
        return int(pipe.prompt_template_encode_start_idx)
    prefix = pipe.prompt_template_encode.split("{}")[0]
    return len(pipe.tokenizer(prefix, add_special_tokens=False)["input_ids"])


@dataclass(kw_only=True)
class QwenImageBundle(DiffusersBundle):
    """All Qwen-Image components. Frozen parts are in eval mode without grads; the transformer is left trainable.

    ``save_pretrained`` writes a ``QwenImagePipeline`` folder; its transformer loads alone with
    ``QwenImageTransformer2DModel.from_pretrained(directory, subfolder="transformer")``.
    """

    pipeline_class_name = "QwenImagePipeline"
    frozen_components = FROZEN_COMPONENTS
    media = "images"

    transformer: torch.nn.Module
    """``QwenImageTransformer2DModel`` (the train backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    vae: torch.nn.Module
    """``AutoencoderKLQwenImage`` (frozen; 16 latent channels in Qwen-Image, normalised by ``latents_mean`` /
    ``latents_std``)."""
    text_encoder: torch.nn.Module
    """``Qwen2_5_VLForConditionalGeneration`` (frozen): its last hidden state over the prompt template."""
    tokenizer: Any
    """Tokenizer of ``text_encoder``."""
    scheduler: Any
    """``FlowMatchEulerDiscreteScheduler`` (only its config is used: the pipeline computes sigmas)."""
    config: QwenImagePipelineConfig
    """The config this bundle was built from."""
    is_demo: bool
    """True for the tiny randomly initialised demo model."""
    _pipe: DiffusersQwenImagePipeline | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: QwenImagePipelineConfig) -> "QwenImageBundle":
        """Load ``config.pretrained_model_ckpt_path`` (local files only) or build the tiny demo model."""
        from diffusers import QwenImagePipeline as DiffusersQwenImagePipeline

        from unirl_ray.models.qwen_image.tiny import build_tiny_qwen_image_pipeline

        if config.is_demo:
            cls._warn_demo(config)
            pipe = build_tiny_qwen_image_pipeline(config.tiny)
            cls._cast([pipe.transformer, pipe.vae, pipe.text_encoder], config.dtype)
        else:
            logger.info("Qwen-Image: loading %s (%s)", config.pretrained_model_ckpt_path, config.torch_dtype)
            pipe = DiffusersQwenImagePipeline.from_pretrained(config.pretrained_model_ckpt_path, dtype=config.dtype,
                                                              local_files_only=True)
        return cls.from_diffusers(pipe, config=config)

    def diffusers_pipeline(self) -> Any:
        """A ``QwenImagePipeline`` over these components, dropping this tokenizer's template prefix."""
        pipe = super().diffusers_pipeline()
        if not getattr(pipe, "_unirl_prefix_counted", False):  # once per pipeline object, not per prompt batch
            pipe.prompt_template_encode_start_idx = template_prefix_tokens(pipe)
            pipe._unirl_prefix_counted = True
        return pipe
