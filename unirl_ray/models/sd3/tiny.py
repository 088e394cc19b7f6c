"""A tiny, randomly initialised but complete ``StableDiffusion3Pipeline`` built offline from configs.

Everything (two CLIP text encoders with projection, a T5 encoder, a VAE, an ``SD3Transformer2DModel``,
a flow-matching Euler scheduler and the three tokenizers) is created in code, so demos and tests run
without any hub download. The weights are a deterministic function of ``TinySD3Config.seed``; the
global torch RNG is left untouched.

Shape rules the builder follows (they are what the SD3 pipeline needs):

- ``joint_attention_dim`` = T5 ``d_model`` >= 2 x CLIP hidden size (the CLIP embeds are padded to it);
- ``pooled_projection_dim`` = sum of the two CLIP projection dims;
- ``caption_projection_dim`` = heads x head_dim;
- image height/width must be divisible by ``vae_scale_factor x patch_size``.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

from unirl_ray.models.sd3.config import TinySD3Config
from unirl_ray.models.tiny_t5 import build_t5_tokenizer, build_tiny_t5_encoder

__all__ = ["TinySD3Config", "build_clip_tokenizer", "build_t5_tokenizer", "build_tiny_sd3_pipeline"]

CLIP_BOS = "<|startoftext|>"
CLIP_EOS = "<|endoftext|>"


def build_clip_tokenizer(max_length: int = 77) -> CLIPTokenizer:
    """A byte-level CLIP tokenizer without merges (one token per byte, word-final variants)."""
    alphabet = sorted(ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for piece in alphabet + [c + "</w>" for c in alphabet] + [CLIP_BOS, CLIP_EOS]:
        vocab[piece] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def _clip_encoder(cfg: TinySD3Config, tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.clip_hidden_size,
        intermediate_size=2 * cfg.clip_hidden_size,
        projection_dim=cfg.clip_projection_dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=cfg.clip_max_length,
        bos_token_id=tokenizer.convert_tokens_to_ids(CLIP_BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(CLIP_EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(CLIP_EOS),
    )
    return CLIPTextModelWithProjection(config)


def _vae(cfg: TinySD3Config) -> AutoencoderKL:
    n = len(cfg.vae_block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(cfg.vae_block_out_channels),
        layers_per_block=1,
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.vae_norm_num_groups,
        sample_size=cfg.sample_size,
        scaling_factor=1.5,
        shift_factor=0.05,
    )


def _transformer(cfg: TinySD3Config) -> SD3Transformer2DModel:
    latent_side = cfg.sample_size // cfg.vae_scale_factor
    return SD3Transformer2DModel(
        sample_size=latent_side,
        patch_size=cfg.patch_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        num_layers=cfg.num_layers,
        attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads,
        joint_attention_dim=cfg.t5_d_model,
        caption_projection_dim=cfg.num_attention_heads * cfg.attention_head_dim,
        pooled_projection_dim=2 * cfg.clip_projection_dim,
        pos_embed_max_size=max(latent_side // cfg.patch_size, 32),
    )


def build_tiny_sd3_pipeline(cfg: TinySD3Config | None = None) -> StableDiffusion3Pipeline:
    """Build the tiny SD3 pipeline (fp32, CPU, eval mode); weights depend only on ``cfg.seed``."""
    cfg = cfg or TinySD3Config()
    tok1, tok2 = build_clip_tokenizer(cfg.clip_max_length), build_clip_tokenizer(cfg.clip_max_length)
    tok3 = build_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        enc1, enc2 = _clip_encoder(cfg, tok1), _clip_encoder(cfg, tok2)
        enc3 = build_tiny_t5_encoder(T5EncoderModel, tok3, cfg.t5_d_model)
        vae = _vae(cfg)
        transformer = _transformer(cfg)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=cfg.scheduler_shift)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=enc1,
        tokenizer=tok1,
        text_encoder_2=enc2,
        tokenizer_2=tok2,
        text_encoder_3=enc3,
        tokenizer_3=tok3,
    )
    for module in (enc1, enc2, enc3, vae, transformer):
        module.eval()
    return pipe
