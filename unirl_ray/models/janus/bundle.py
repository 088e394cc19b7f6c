"""``JanusBundle``: a Janus-Pro model (trainable, behind ``JanusPolicy``) and its tokenizer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from unirl_ray.models.janus.config import JanusModelConfig, TinyJanusConfig

logger = logging.getLogger(__name__)


@dataclass
class ImageTokenOutput(ModelOutput):
    """Image-token logits of a ``JanusPolicy`` image forward (and the KV cache while sampling)."""

    logits: torch.Tensor | None = None
    """[B, L, codebook] generation-head logits."""
    past_key_values: Any = None
    """The backbone's KV cache (``use_cache=True``)."""


class JanusPolicy(nn.Module):
    """The trainable module: ``JanusForConditionalGeneration`` with every path behind one ``forward`` (so FSDP2's
    root hooks gather the parameters of whichever path runs).

    - text: ``forward(input_ids, attention_mask, position_ids, ...)`` is the model's own causal-LM forward (LM head);
    - image tokens: with ``image_ids`` [B, Li] the sequence is the text embeddings of ``input_ids`` followed by the
      generation embeddings of ``image_ids`` (sampling, KV cache), or, with ``image_positions`` [B, L] bool, one
      layout mixing both (training: text ids where it is False, image ids where it is True); the logits are the
      generation head's over the VQ codebook;
    - ``decode_tokens`` [B, N]: the VQ decoder's pixels [B, H, W, 3] in [-1, 1].
    """

    def __init__(self, janus: nn.Module) -> None:
        super().__init__()
        self.janus = janus

    @property
    def config(self):  # noqa: ANN201 - the causal-LM view CausalLMPipeline reads (length limit)
        return self.janus.config.text_config

    @property
    def generation_config(self):  # noqa: ANN201 - stop tokens
        return self.janus.generation_config

    def frozen_parameters(self) -> list[nn.Parameter]:
        """What full fine-tuning leaves frozen (``FSDPBackend``): the understanding tower and its aligner, and the VQ
        model (its decoder only turns tokens into pixels). No loss of the text or image-token stages reaches them."""
        model = self.janus.model
        return [p for m in (model.vision_model, model.aligner, model.vqmodel) for p in m.parameters()]

    @property
    def num_image_tokens(self) -> int:
        return int(self.janus.config.vision_config.num_image_tokens)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, image_ids: torch.Tensor | None = None,
                image_positions: torch.Tensor | None = None, decode_tokens: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if decode_tokens is not None:
            return self.janus.decode_image_tokens(decode_tokens)
        if image_ids is None:
            return self.janus(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        model = self.janus.model
        images = self.janus.prepare_embeddings_for_image_generation(image_ids)
        if image_positions is not None:  # one layout: text ids where False, image ids where True
            text = model.get_input_embeddings()(input_ids)
            embeds = torch.where(image_positions[..., None], images.to(text.dtype), text)
        elif input_ids is not None:
            embeds = torch.cat([model.get_input_embeddings()(input_ids), images], dim=1)
        else:
            embeds = images
        out = model.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                                   **kwargs)
        return ImageTokenOutput(logits=model.generation_head(out.last_hidden_state),
                                past_key_values=out.past_key_values)


def build_tiny_janus(tiny: TinyJanusConfig, tokenizer: Any) -> nn.Module:
    """A randomly initialised tiny ``JanusForConditionalGeneration`` (weights depend only on ``tiny.seed``)."""
    from transformers import JanusConfig, JanusForConditionalGeneration, LlamaConfig
    from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig

    h = tiny.hidden_size
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=h, intermediate_size=tiny.intermediate_size,
                       num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_attention_heads,
                       num_key_value_heads=tiny.num_attention_heads, max_position_embeddings=tiny.max_position_embeddings,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    tokens = tiny.image_tokens_per_side ** 2
    vision = JanusVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=tiny.image_size,
                               patch_size=tiny.image_size // tiny.image_tokens_per_side, projection_dim=h, depth=1,
                               num_image_tokens=tokens)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=tiny.codebook_size, latent_channels=8, base_channels=32,
                          channel_multiplier=[1] * tiny.vq_levels, num_res_blocks=1, num_patches=tiny.image_tokens_per_side,
                          projection_dim=h, image_token_embed_dim=h, num_hidden_layers=2)
    config = JanusConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), vq_config=vq.to_dict(),
                         image_token_id=tokenizer.unk_token_id, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = JanusForConditionalGeneration(config)
        # transformers' 0.02-std init leaves a random VQ decoder nearly blind to its tokens (every demo image the
        # same grey, +-0.2% brightness): torch's default init, a unit-variance codebook and a wider output layer
        # make the tokens show in the pixels (the brightest token's image is ~3 random images' spreads brighter)
        for module in model.model.vqmodel.modules():
            if hasattr(module, "reset_parameters") and module is not model.model.vqmodel.quantize:
                module.reset_parameters()
        torch.nn.init.normal_(model.model.vqmodel.quantize.embedding.weight, std=1.0)
        with torch.no_grad():
            model.model.vqmodel.decoder.conv_out.weight.mul_(8.0)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id
    gen.generation_kwargs = {"boi_token_id": tokenizer.bos_token_id}  # the demo's begin-of-image marker
    gen._from_model_config = False  # noqa: SLF001 - else from_pretrained rebuilds it from config.json, dropping the marker
    return model


def _processor_chat_template(path: str) -> str | None:
    """The chat template a Janus folder stores next to its processor (``chat_template.json`` / ``.jinja``), if any."""
    import json

    for name in ("chat_template.jinja", "chat_template.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                return f.read() if name.endswith(".jinja") else json.load(f).get("chat_template")
    return None


@dataclass(kw_only=True)
class JanusBundle:
    """A Janus model and its tokenizer; ``model`` is what the backend trains (``trainable_attr: model``)."""

    model: JanusPolicy
    """The trainable module (the backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    tokenizer: Any
    """Hugging Face tokenizer with a pad and an EOS token."""
    config: JanusModelConfig
    """The config this bundle was built from."""
    is_demo: bool
    """True for the tiny randomly initialised demo model."""

    @classmethod
    def from_config(cls, config: JanusModelConfig) -> "JanusBundle":
        """Load ``config.pretrained_model_path`` (local files only) or build the tiny demo model."""
        if config.is_demo:
            from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer

            logger.warning("Janus: no pretrained_model_path given; building a TINY RANDOMLY INITIALISED DEMO model (%s) "
                           "with a char-level tokenizer: set pretrained_model_path for real training", config.tiny)
            tokenizer = build_char_tokenizer()
            janus = build_tiny_janus(config.tiny, tokenizer)
        else:
            from transformers import JanusForConditionalGeneration

            from unirl_ray.models.causal_lm.bundle import _load_tokenizer

            path = os.path.expanduser(config.pretrained_model_path)
            janus = JanusForConditionalGeneration.from_pretrained(path, dtype=config.dtype, local_files_only=True)
            tokenizer = _load_tokenizer(path)  # a real folder's tokenizer; the demo's char tokenizer read back as such
            if not getattr(tokenizer, "chat_template", None):  # Janus-Pro folders keep it with the processor
                tokenizer.chat_template = _processor_chat_template(path)
        model = JanusPolicy(janus.to(config.dtype)).eval()
        return cls(model=model, tokenizer=tokenizer, config=config, is_demo=config.is_demo)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.config.dtype

    @property
    def boi_token_id(self) -> int:
        """The token that opens the image segment (Janus-Pro's ``<begin_of_image>``)."""
        kwargs = getattr(self.model.generation_config, "generation_kwargs", None) or {}
        if "boi_token_id" not in kwargs:
            raise ValueError("the model's generation_config has no generation_kwargs.boi_token_id (Janus-Pro folders "
                             "have it): this does not look like a Janus image-generation checkpoint")
        return int(kwargs["boi_token_id"])

    def to(self, device: torch.device | str) -> "JanusBundle":
        self.model.to(device)
        return self

    def save_pretrained(self, directory: str) -> str:
        """The model (``JanusForConditionalGeneration.from_pretrained(directory)``) and tokenizer; returns ``directory``.
        ``JanusModelConfig(pretrained_model_path=directory)`` loads it (the demo's char tokenizer too)."""
        os.makedirs(directory, exist_ok=True)
        self.model.janus.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return directory
