"""A tiny, randomly initialised but complete ``FluxPipeline`` built offline from configs.

Everything (a CLIP text encoder, a T5 encoder, a VAE, a ``FluxTransformer2DModel`` with guidance embedding, a
flow-matching Euler scheduler with FLUX's resolution-dependent shift, and the two tokenizers) is created in
code, so demos and tests run without any hub download. The weights are a deterministic function of
``TinyFluxConfig.seed``; the global torch RNG is left untouched.

Shape rules the builder follows (what the FLUX pipeline needs): the transformer's ``in_channels`` is 4 x the
VAE's latent channels (2 x 2 packing), ``joint_attention_dim`` the T5 width, ``pooled_projection_dim`` the
CLIP width (its pooled output), and ``axes_dims_rope`` sums to the head width.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextConfig, CLIPTextModel, T5EncoderModel

from unirl_ray.models.flux.config import PACK, TinyFluxConfig
from unirl_ray.models.sd3.tiny import CLIP_BOS, CLIP_EOS, build_clip_tokenizer
from unirl_ray.models.tiny_t5 import build_t5_tokenizer, build_tiny_t5_encoder

__all__ = ["TinyFluxConfig", "build_tiny_flux_pipeline"]


def _clip_encoder(cfg: TinyFluxConfig, tokenizer) -> CLIPTextModel:
    eos = tokenizer.convert_tokens_to_ids(CLIP_EOS)
    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.clip_hidden_size, intermediate_size=2 * cfg.clip_hidden_size,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=cfg.clip_max_length,
        bos_token_id=tokenizer.convert_tokens_to_ids(CLIP_BOS), eos_token_id=eos, pad_token_id=eos))


def _vae(cfg: TinyFluxConfig) -> AutoencoderKL:
    n = len(cfg.vae_block_out_channels)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=tuple(cfg.vae_block_out_channels),
        layers_per_block=1, latent_channels=cfg.latent_channels, norm_num_groups=1, sample_size=cfg.sample_size,
        scaling_factor=1.5, shift_factor=0.05)


def _transformer(cfg: TinyFluxConfig) -> FluxTransformer2DModel:
    quarter = cfg.attention_head_dim // 4
    return FluxTransformer2DModel(
        patch_size=1, in_channels=cfg.latent_channels * PACK * PACK, num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, joint_attention_dim=cfg.t5_d_model,
        pooled_projection_dim=cfg.clip_hidden_size, guidance_embeds=cfg.guidance_embeds,
        axes_dims_rope=(quarter, quarter, 2 * quarter))


def build_tiny_flux_pipeline(cfg: TinyFluxConfig | None = None) -> FluxPipeline:
    """Build the tiny FLUX pipeline (fp32, CPU, eval mode); weights depend only on ``cfg.seed``."""
    cfg = cfg or TinyFluxConfig()
    tok, tok2 = build_clip_tokenizer(cfg.clip_max_length), build_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        enc, enc2 = _clip_encoder(cfg, tok), build_tiny_t5_encoder(T5EncoderModel, tok2, cfg.t5_d_model)
        vae, transformer = _vae(cfg), _transformer(cfg)
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's: the shift grows with the image's token count
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=enc, tokenizer=tok, text_encoder_2=enc2,
                        tokenizer_2=tok2, transformer=transformer)
    for module in (enc, enc2, vae, transformer):
        module.eval()
    return pipe
