"""Write a diffusers folder with a real model's architecture and random weights (no download).

A full-size dry run of a real-model recipe before the weights are on the cluster: the folder has the
layout of the published checkpoint (``model_index.json``, one sub-folder per component, safetensors
weights in the chosen dtype), the published architecture configs of the transformer, the VAE and
the text encoders, so loading, FSDP2 wrapping, LoRA targets, memory and step time are those of the
real model. What is NOT real: the weights (random, so images are noise and rewards meaningless)
and the tokenizers (the byte-level CLIP / character-level T5 stand-ins of the tiny demo models,
whose ids are valid for the real vocabularies).

    python -m unirl_ray.tools.random_checkpoint sd3.5-medium /tmp/sd35m            # weights on the GPU if any
    python -m unirl_ray.tools.random_checkpoint wan2.1-t2v-1.3b /tmp/wan --configs-only
    PRETRAINED_MODEL=/tmp/sd35m python recipes/sd3.py recipes/diffusion/sd3/sd3_5_medium_flowgrpo.yaml

``--configs-only`` writes every config and tokenizer but no weights (seconds, a few kB): enough for
the driver-side recipe checks, which read the folder's configs.

Weights are built in float32 and then cast, so building needs ~4 bytes per parameter on the device
(~32 GB for SD3.5 Medium, ~29 GB for Wan2.1 1.3B with its UMT5); on one H200 each folder took
under 15 s to build and 16-23 s to write.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from unirl_ray.core.dtypes import TORCH_DTYPES

__all__ = ["FAMILIES", "build_pipeline", "count_parameters", "write_checkpoint"]


# ------------------------------------------------------------------------------ architectures
# Published configs of the checkpoints' components (diffusers / transformers argument names).

SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
SD3_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305,
    shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu", max_position_embeddings=77, vocab_size=49408)
CLIP_BIG_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                  projection_dim=1280, hidden_act="gelu", max_position_embeddings=77, vocab_size=49408)
T5_XXL_ENCODER = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                      relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)
UMT5_XXL_ENCODER = dict(T5_XXL_ENCODER, vocab_size=256384)
WAN21_T2V_1_3B_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0)  # latents mean/std: the class defaults (Wan2.1's)


FLUX1_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
FLUX_VAE = dict(SD3_VAE, scaling_factor=0.3611, shift_factor=0.1159)
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)

QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)  # latents mean/std: the class defaults
QWEN25_VL_7B = dict(  # Qwen2.5-VL-7B-Instruct, Qwen-Image's text encoder (its vision tower included)
    text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                     tie_word_embeddings=False),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2),
    tie_word_embeddings=False,
)


def _clip(arch: dict[str, Any], tokenizer: Any) -> torch.nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from unirl_ray.models.sd3.tiny import CLIP_BOS, CLIP_EOS

    eos = tokenizer.convert_tokens_to_ids(CLIP_EOS)
    config = CLIPTextConfig(**arch, bos_token_id=tokenizer.convert_tokens_to_ids(CLIP_BOS), eos_token_id=eos,
                            pad_token_id=eos)
    return CLIPTextModelWithProjection(config)


def _sd35_medium() -> Any:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    from unirl_ray.models.sd3.tiny import build_clip_tokenizer, build_t5_tokenizer

    tok1, tok2, tok3 = build_clip_tokenizer(77), build_clip_tokenizer(77), build_t5_tokenizer()
    with torch.device("cpu"):  # the scheduler keeps CPU tensors, whatever the modules' device
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER),
        scheduler=scheduler,
        vae=AutoencoderKL(**SD3_VAE),
        text_encoder=_clip(CLIP_L, tok1), tokenizer=tok1,
        text_encoder_2=_clip(CLIP_BIG_G, tok2), tokenizer_2=tok2,
        text_encoder_3=T5EncoderModel(T5Config(**T5_XXL_ENCODER)), tokenizer_3=tok3,
    )


def _wan21_t2v_1_3b() -> Any:
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanTransformer3DModel,
    )
    from diffusers import WanPipeline as DiffusersWanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from unirl_ray.models.tiny_t5 import build_t5_tokenizer

    with torch.device("cpu"):  # the scheduler keeps CPU tensors, whatever the modules' device
        scheduler = UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                            use_flow_sigmas=True, flow_shift=3.0)
    return DiffusersWanPipeline(
        tokenizer=build_t5_tokenizer(), text_encoder=UMT5EncoderModel(UMT5Config(**UMT5_XXL_ENCODER)),
        vae=AutoencoderKLWan(**WAN21_VAE), transformer=WanTransformer3DModel(**WAN21_T2V_1_3B_TRANSFORMER),
        scheduler=scheduler,
    )


def _flux1_dev() -> Any:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from unirl_ray.models.sd3.tiny import CLIP_BOS, CLIP_EOS, build_clip_tokenizer, build_t5_tokenizer

    tok1, tok2 = build_clip_tokenizer(77), build_t5_tokenizer()
    eos = tok1.convert_tokens_to_ids(CLIP_EOS)
    with torch.device("cpu"):  # the scheduler keeps CPU tensors, whatever the modules' device
        scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    return FluxPipeline(  # CLIP-L without its projection: FLUX reads the pooled output
        transformer=FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER), scheduler=scheduler, vae=AutoencoderKL(**FLUX_VAE),
        text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP_L, bos_token_id=tok1.convert_tokens_to_ids(CLIP_BOS),
                                                  eos_token_id=eos, pad_token_id=eos)), tokenizer=tok1,
        text_encoder_2=T5EncoderModel(T5Config(**T5_XXL_ENCODER)), tokenizer_2=tok2,
    )


def _qwen_image() -> Any:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from unirl_ray.models.causal_lm.tokenizer import build_char_tokenizer
    from unirl_ray.models.qwen_image.tiny import QWEN_MARKERS, SCHEDULER

    tokenizer = build_char_tokenizer(QWEN_MARKERS)  # its ids are valid ids of Qwen's vocabulary
    tokenizer.padding_side = "right"
    with torch.device("cpu"):  # the scheduler keeps CPU tensors, whatever the modules' device
        scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    return QwenImagePipeline(
        transformer=QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER), scheduler=scheduler,
        vae=AutoencoderKLQwenImage(**QWEN_IMAGE_VAE), tokenizer=tokenizer,
        text_encoder=Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B)),
    )


@dataclass(frozen=True)
class Family:
    """One published checkpoint's architecture."""

    build: Callable[[], Any]
    """Builds the diffusers pipeline (random weights) on the current default device."""
    modules: tuple[str, ...]
    """The pipeline's weight-carrying components."""


FAMILIES: dict[str, Family] = {
    "sd3.5-medium": Family(
        build=_sd35_medium,
        modules=("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"),
    ),
    "wan2.1-t2v-1.3b": Family(
        build=_wan21_t2v_1_3b,
        modules=("transformer", "vae", "text_encoder"),
    ),
    "flux.1-dev": Family(
        build=_flux1_dev,
        modules=("transformer", "vae", "text_encoder", "text_encoder_2"),
    ),
    "qwen-image": Family(
        build=_qwen_image,
        modules=("transformer", "vae", "text_encoder"),
    ),
}


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def build_pipeline(name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                   seed: int = 0) -> Any:
    """The family's diffusers pipeline with random weights on ``device`` (``"meta"``: shapes only).

    Modules are created in float32 (the libraries' initialisers) and then cast to ``dtype``; the
    global torch RNG is left untouched.
    """
    family = _family(name)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        pipe = family.build()
    if str(device) != "meta":
        for module in family.modules:
            torch.nn.Module.to(getattr(pipe, module), dtype=dtype)
    return pipe


def count_parameters(pipe: Any, name: str) -> dict[str, int]:
    """Parameters per weight-carrying component of a family's pipeline."""
    return {m: sum(p.numel() for p in getattr(pipe, m).parameters()) for m in _family(name).modules}


def _write_configs_only(pipe: Any, name: str, directory: str) -> None:
    pipe.save_config(directory)  # model_index.json
    for component in _family(name).modules:
        module = getattr(pipe, component)
        sub = os.path.join(directory, component)
        os.makedirs(sub, exist_ok=True)
        if hasattr(module, "save_config"):  # diffusers ModelMixin
            module.save_config(sub)
        else:  # transformers PreTrainedModel
            module.config.save_pretrained(sub)
    for component in ("scheduler", "tokenizer", "tokenizer_2", "tokenizer_3"):
        part = getattr(pipe, component, None)
        if part is None:
            continue
        sub = os.path.join(directory, component)
        if hasattr(part, "save_pretrained"):
            part.save_pretrained(sub)


def write_checkpoint(name: str, directory: str, *, device: str | torch.device | None = None,
                     dtype: str = "bfloat16", configs_only: bool = False, seed: int = 0) -> dict[str, Any]:
    """Write family ``name`` as a diffusers folder in ``directory``; returns what was written and timings.

    ``configs_only`` builds on the meta device and writes configs, tokenizers and the scheduler only.
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    if os.path.exists(os.path.join(directory, "model_index.json")):
        raise FileExistsError(f"{directory!r} already holds a diffusers folder; choose an empty directory")
    os.makedirs(directory, exist_ok=True)
    if device is None:
        device = "meta" if configs_only else ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    pipe = build_pipeline(name, device="meta" if configs_only else device, dtype=TORCH_DTYPES[dtype], seed=seed)
    built = time.perf_counter() - t0
    params = count_parameters(pipe, name)
    if configs_only:
        _write_configs_only(pipe, name, directory)
    else:
        pipe.save_pretrained(directory, safe_serialization=True)
    written = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory) for f in files)
    info = {"family": name, "directory": directory, "dtype": dtype, "configs_only": configs_only,
            "parameters": params, "bytes": written, "build_s": round(built, 2),
            "write_s": round(time.perf_counter() - t0 - built, 2)}
    with open(os.path.join(directory, "random_checkpoint.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in info.items() if k != "directory"}, f, indent=1)
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("directory")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES))
    parser.add_argument("--device", default=None, help="where to build the weights (default: cuda if available)")
    parser.add_argument("--configs-only", action="store_true", help="configs and tokenizers, no weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = write_checkpoint(args.family, args.directory, device=args.device, dtype=args.dtype,
                            configs_only=args.configs_only, seed=args.seed)
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
