"""A tiny, randomly initialised but complete diffusers ``WanPipeline`` built offline from configs.

A UMT5 text encoder, a causal video VAE (``AutoencoderKLWan``), a ``WanTransformer3DModel``, a
flow-matching Euler scheduler and a character-level T5 tokenizer are created in code, so demos and
tests run without any hub download. The weights are a deterministic function of ``TinyWanConfig.seed``;
the global torch RNG is left untouched. Defaults: 5 frames of 16 x 16 give latents ``[4, 3, 8, 8]``.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers import WanPipeline as DiffusersWanPipeline
from transformers import UMT5EncoderModel

from unirl_ray.models.tiny_t5 import build_t5_tokenizer, build_tiny_t5_encoder
from unirl_ray.models.wan.config import TinyWanConfig

__all__ = ["TinyWanConfig", "build_tiny_wan_pipeline"]


def _vae(cfg: TinyWanConfig) -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=cfg.vae_base_dim,
        z_dim=cfg.latent_channels,
        dim_mult=list(cfg.vae_dim_mult),
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=list(cfg.vae_temporal_downsample),
        latents_mean=[0.0] * cfg.latent_channels,
        latents_std=[1.0] * cfg.latent_channels,
        scale_factor_temporal=cfg.scale_factor_temporal,
        scale_factor_spatial=cfg.scale_factor_spatial,
    )


def _transformer(cfg: TinyWanConfig) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=tuple(cfg.patch_size),
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        rope_max_seq_len=64,
    )


def build_tiny_wan_pipeline(cfg: TinyWanConfig | None = None) -> DiffusersWanPipeline:
    """Build the tiny Wan pipeline (fp32, CPU, eval mode); weights depend only on ``cfg.seed``."""
    cfg = cfg or TinyWanConfig()
    tokenizer = build_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        text_encoder = build_tiny_t5_encoder(UMT5EncoderModel, tokenizer, cfg.text_dim)
        vae = _vae(cfg)
        transformer = _transformer(cfg)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.scheduler_shift)
    pipe = DiffusersWanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    for module in (text_encoder, vae, transformer):
        module.eval()
    return pipe
