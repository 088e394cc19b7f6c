"""A tiny, randomly initialised but complete diffusers ``QwenImagePipeline`` built offline from configs.

Everything (a Qwen2.5-VL text encoder with its vision tower, the causal VAE, a ``QwenImageTransformer2DModel``,
a flow-matching Euler scheduler with Qwen-Image's exponential resolution-dependent shift, and a character-level
tokenizer with Qwen's ``<|im_start|>`` / ``<|im_end|>`` markers as single tokens) is created in code, so demos
and tests run without any hub download. The weights are a deterministic function of
``TinyQwenImageConfig.seed``; the global torch RNG is left untouched.

Shape rules the builder follows (what the Qwen-Image pipeline needs): the transformer's ``in_channels`` is 4 x
the VAE's latent channels (2 x 2 packing) and its ``out_channels`` the latent channels, ``joint_attention_dim``
the text encoder's width, ``axes_dims_rope`` sums to the head width, and the text encoder's rotary sections
(``mrope_section``) sum to half its head width.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer
from unirl_ray.models.qwen_image.config import PACK, TinyQwenImageConfig

__all__ = ["TinyQwenImageConfig", "build_tiny_qwen_image_pipeline", "QWEN_MARKERS", "SCHEDULER"]

QWEN_MARKERS = ("<|im_start|>", "<|im_end|>")
"""The chat markers of Qwen-Image's prompt template, single tokens of the tiny tokenizer."""

SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
"""Qwen-Image's flow-matching scheduler (``scheduler/scheduler_config.json`` of the published model)."""


def _text_encoder(cfg: TinyQwenImageConfig, tokenizer) -> Qwen2_5_VLForConditionalGeneration:
    heads = 2
    half = cfg.text_hidden_size // heads // 2  # the rotary frequencies of a head: temporal, height, width sections
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=cfg.text_hidden_size,
                         intermediate_size=2 * cfg.text_hidden_size, num_hidden_layers=cfg.text_layers,
                         num_attention_heads=heads, num_key_value_heads=1, max_position_embeddings=1024,
                         rope_scaling={"type": "mrope", "mrope_section": sections}, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=cfg.text_hidden_size,
                           fullatt_block_indexes=[0]),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _vae(cfg: TinyQwenImageConfig) -> AutoencoderKLQwenImage:
    return AutoencoderKLQwenImage(
        base_dim=cfg.vae_base_dim, z_dim=cfg.latent_channels, dim_mult=[1] + [2] * cfg.vae_levels, num_res_blocks=1,
        attn_scales=[], temperal_downsample=[False] * cfg.vae_levels,
        latents_mean=[0.1 * i for i in range(cfg.latent_channels)], latents_std=[1.0 + 0.5 * i for i in range(cfg.latent_channels)])


def _transformer(cfg: TinyQwenImageConfig) -> QwenImageTransformer2DModel:
    quarter = cfg.attention_head_dim // 4
    return QwenImageTransformer2DModel(
        patch_size=PACK, in_channels=cfg.latent_channels * PACK * PACK, out_channels=cfg.latent_channels,
        num_layers=cfg.num_layers, attention_head_dim=cfg.attention_head_dim, num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.text_hidden_size, axes_dims_rope=(quarter, quarter, 2 * quarter))


def build_tiny_qwen_image_pipeline(cfg: TinyQwenImageConfig | None = None) -> QwenImagePipeline:
    """Build the tiny Qwen-Image pipeline (fp32, CPU, eval mode); weights depend only on ``cfg.seed``."""
    cfg = cfg or TinyQwenImageConfig()
    tokenizer = build_char_tokenizer(QWEN_MARKERS)
    tokenizer.padding_side = "right"  # as Qwen's tokenizer pads
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        text_encoder = _text_encoder(cfg, tokenizer)
        vae = _vae(cfg)
        transformer = _transformer(cfg)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, text_encoder=text_encoder,
                             tokenizer=tokenizer, transformer=transformer)
    for module in (text_encoder, vae, transformer):
        module.eval()
    return pipe
