"""``VLMBundle``: a Qwen2.5-VL model, its tokenizer and image processor, from a local folder or a tiny demo."""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass
from typing import Any

import torch

from unirl_ray.models.causal_lm.bundle import CausalLMBundle, _load_tokenizer
from unirl_ray.models.vlm.config import TinyVLMConfig, VLMConfig

logger = logging.getLogger(__name__)

VL_MARKERS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2.5-VL's chat and vision markers: single tokens of the tiny model's character-level tokenizer."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The tiny model's chat template: Qwen2.5-VL's layout (an image is ``<|vision_start|><|image_pad|><|vision_end|>``,
which the processor expands to one ``<|image_pad|>`` per image token)."""


def build_tiny_vlm(tiny: TinyVLMConfig) -> tuple[torch.nn.Module, Any, Any]:
    """A randomly initialised tiny ``Qwen2_5_VLForConditionalGeneration``, its tokenizer (character-level, with
    Qwen's markers and chat layout) and its image processor (Qwen2-VL's, at ``tiny.image_size`` pixels a side);
    weights depend only on ``tiny.seed`` (the global RNG is left untouched)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(VL_MARKERS)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {marker: tokenizer.convert_tokens_to_ids(marker) for marker in VL_MARKERS}
    pixels = tiny.image_size * tiny.image_size
    images = Qwen2VLImageProcessorPil(patch_size=tiny.patch_size, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": pixels, "longest_edge": pixels})
    heads, half = 2, tiny.hidden_size // 4  # half a head's rotary frequencies: temporal, height, width sections
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=tiny.hidden_size, intermediate_size=2 * tiny.hidden_size,
                         num_hidden_layers=tiny.num_layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=tiny.max_position_embeddings,
                         rope_scaling={"type": "mrope", "mrope_section": sections}, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(depth=tiny.vision_depth, hidden_size=tiny.vision_hidden_size,
                           intermediate_size=2 * tiny.vision_hidden_size, num_heads=2, out_hidden_size=tiny.hidden_size,
                           patch_size=tiny.patch_size, spatial_merge_size=2, temporal_patch_size=2,
                           window_size=4 * tiny.patch_size, fullatt_block_indexes=list(range(tiny.vision_depth))),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer, images


def _vision_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The vision tower's parameters (its patch embedding, blocks and merger): what ``freeze_vision`` keeps."""
    return list(model.model.visual.parameters())


@dataclass(kw_only=True)
class VLMBundle(CausalLMBundle):
    """A Qwen2.5-VL model (in eval mode: no dropout, so recomputed log-probs match sampled ones), its tokenizer
    (with the chat template) and its image processor: a causal LM that also reads images.

    With ``config.freeze_vision`` the model answers ``frozen_parameters()`` with its vision tower, which the train
    backend keeps frozen in a full fine-tune (LoRA adapters go where ``lora_cfg.target_modules`` say)."""

    model: torch.nn.Module
    """``Qwen2_5_VLForConditionalGeneration`` (the train backend may wrap it, e.g. LoRA + FSDP2, in place)."""
    image_processor: Any
    """Qwen2-VL's image processor: resizes (to a multiple of patch x merge, within min / max pixels), patches."""
    config: VLMConfig
    """The config this bundle was built from."""

    @classmethod
    def from_config(cls, config: VLMConfig) -> "VLMBundle":
        """Load ``config.pretrained_model_path`` (local files only) or build the tiny demo model."""
        if config.is_demo:
            logger.warning("VLM: no pretrained_model_path given; building a TINY RANDOMLY INITIALISED DEMO Qwen2.5-VL "
                           "(%s). Its text is gibberish: set pretrained_model_path for real training.", config.tiny)
            model, tokenizer, image_processor = build_tiny_vlm(config.tiny)
            model = model.to(config.dtype)
        else:
            model, tokenizer, image_processor = _load(config)
        if config.min_pixels or config.max_pixels:
            size = dict(image_processor.size)
            size.update({k: v for k, v in (("shortest_edge", config.min_pixels), ("longest_edge", config.max_pixels)) if v})
            image_processor.size = size
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.eval()
        if config.freeze_vision:
            model.frozen_parameters = types.MethodType(_vision_parameters, model)
        return cls(model=model, tokenizer=tokenizer, image_processor=image_processor, config=config,
                   is_demo=config.is_demo)

    def save_pretrained(self, directory: str) -> str:
        """Write the model (safetensors), its tokenizer (with the chat template) and its image processor to
        ``directory``, a valid ``pretrained_model_path``; returns ``directory``. The family's export hook."""
        super().save_pretrained(directory)
        self.image_processor.save_pretrained(directory)
        return directory


def _load(config: VLMConfig) -> tuple[torch.nn.Module, Any, Any]:
    """Model, tokenizer and (PIL) image processor of a local Qwen2.5-VL folder; the chat template from the tokenizer,
    else from the folder's ``chat_template.json`` / ``chat_template.jinja`` (where processors keep it)."""
    import json

    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    path = config.pretrained_model_path
    logger.info("VLM: loading %s (%s)", path, config.torch_dtype)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=config.dtype, local_files_only=True)
    tokenizer = _load_tokenizer(path)
    if not getattr(tokenizer, "chat_template", None):
        for name in ("chat_template.jinja", "chat_template.json"):
            file = os.path.join(path, name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    tokenizer.chat_template = json.load(f)["chat_template"] if name.endswith(".json") else f.read()
                break
    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True, backend="pil")
    return model, tokenizer, image_processor
