"""``UnifiedTransformer``: a causal-LM backbone that also predicts flow-matching velocities on image tokens.

Sequence of an image forward (one row)::

    [ text tokens (prompt + generated think segment, right-padded) | image-start | patch_1 ... patch_N ]

Text positions are token embeddings; the image-start position is a learned vector plus the timestep
embedding; patch positions are ``patch_embed(latent patch) + 2-D sin-cos position + timestep embedding``.
The 4-D additive float mask (``unified_attention_mask``) lets a text position see the valid text
positions up to itself (causal), and an image position see every valid text position and every image
position (bidirectional within the image block). RoPE positions run on from the last valid text token
through the image block. The velocity head reads the patch positions.

A text forward (``input_ids`` without ``image_latents``) is the backbone's own causal-LM forward, KV cache
included, so the text stage's sampler and log-probs (``CausalLMPipeline``) run on this module unchanged.
"""

from __future__ import annotations

import json
import math
import os

import torch
from torch import nn

from unirl_ray.models.unified.config import UNIFIED_CONFIG

HEADS_FILE = "image_heads.safetensors"
"""The image-side weights (patch / timestep embeddings, image start, velocity head) in ``transformer/``."""
LM_DIR = "lm"
"""The backbone's ``from_pretrained`` folder (a ``*ForCausalLM``) inside ``transformer/``."""
TIME_DIM = 64
"""Width of the sinusoidal timestep features."""


def unified_attention_mask(text_mask: torch.Tensor, num_image: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, L, L] additive mask (0 = attend, ``finfo(dtype).min`` = not) for ``L = Lt + num_image``.

    ``text_mask`` [B, Lt] marks valid text positions. Text queries attend causally to valid text keys; image
    queries attend to every valid text key and to the whole image block. A padded text query attends to
    itself only (a row without any key would be NaN); no valid query attends to it.
    """
    valid = text_mask.bool()
    b, lt = valid.shape
    length = lt + num_image
    allowed = torch.zeros(b, length, length, dtype=torch.bool, device=valid.device)
    causal = torch.ones(lt, lt, dtype=torch.bool, device=valid.device).tril()
    allowed[:, :lt, :lt] = causal & valid[:, None, :] & valid[:, :, None]
    allowed[:, lt:, :lt] = valid[:, None, :]
    allowed[:, lt:, lt:] = True
    diag = torch.arange(lt, device=valid.device)
    allowed[:, diag, diag] |= ~valid
    mask = torch.zeros(b, 1, length, length, dtype=dtype, device=valid.device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def timestep_features(sigma: torch.Tensor, dim: int = TIME_DIM) -> torch.Tensor:
    """[B, dim] sinusoidal features of the noise level ``sigma`` [B] (scaled to 0..1000)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=sigma.device) / half)
    angles = sigma.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def sincos_2d(rows: int, cols: int, dim: int, device: torch.device) -> torch.Tensor:
    """[rows * cols, dim] fixed 2-D sin-cos position embedding (row-major patches)."""
    quarter = dim // 4
    freqs = torch.exp(-math.log(10000.0) * torch.arange(quarter, dtype=torch.float32, device=device) / quarter)
    r = torch.arange(rows, dtype=torch.float32, device=device)[:, None] * freqs[None]
    c = torch.arange(cols, dtype=torch.float32, device=device)[:, None] * freqs[None]
    r_emb = torch.cat([r.sin(), r.cos()], dim=-1)[:, None, :].expand(rows, cols, 2 * quarter)
    c_emb = torch.cat([c.sin(), c.cos()], dim=-1)[None, :, :].expand(rows, cols, 2 * quarter)
    return torch.cat([r_emb, c_emb], dim=-1).reshape(rows * cols, 4 * quarter)


class UnifiedTransformer(nn.Module):
    """The trainable module of the unified family (see the module docstring)."""

    def __init__(self, lm: nn.Module, *, latent_channels: int, patch_size: int, vae_scale_factor: int) -> None:
        super().__init__()
        self.lm = lm
        self.latent_channels, self.patch_size, self.vae_scale_factor = latent_channels, patch_size, vae_scale_factor
        hidden = int(lm.config.hidden_size)
        patch_dim = latent_channels * patch_size * patch_size
        self.patch_embed = nn.Linear(patch_dim, hidden)
        self.time_embed = nn.Sequential(nn.Linear(TIME_DIM, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.image_start = nn.Parameter(torch.randn(hidden) * 0.02)
        self.velocity_norm = nn.LayerNorm(hidden)
        self.velocity_head = nn.Linear(hidden, patch_dim)

    # the causal-LM view that CausalLMPipeline reads (stop tokens, length limit)
    @property
    def config(self):  # noqa: ANN201 - the backbone's transformers config
        return self.lm.config

    @property
    def generation_config(self):  # noqa: ANN201
        return self.lm.generation_config

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, image_latents: torch.Tensor | None = None,
                sigma: torch.Tensor | None = None, **kwargs):  # noqa: ANN201 - LM output or a velocity tensor
        """Text forward (the backbone's causal-LM output) or, with ``image_latents`` [B, C, h, w] and ``sigma`` [B],
        the velocity [B, C, h, w] (float32) conditioned on ``input_ids`` [B, Lt] under ``attention_mask`` [B, Lt]."""
        if image_latents is None:
            return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        if sigma is None or input_ids is None or attention_mask is None:
            raise ValueError("an image forward needs input_ids, attention_mask (of the text), image_latents and sigma")
        return self._velocity(input_ids, attention_mask, image_latents, sigma)

    def _velocity(self, text_ids: torch.Tensor, text_mask: torch.Tensor, x: torch.Tensor,
                  sigma: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.patch_size
        hidden = self.hidden_states(text_ids, text_mask, x, sigma)
        tokens = hidden[:, text_ids.shape[1] + 1 :]
        v = self.velocity_head(self.velocity_norm(tokens)).float()
        return v.reshape(b, h // p, w // p, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    def hidden_states(self, text_ids: torch.Tensor, text_mask: torch.Tensor, x: torch.Tensor,
                      sigma: torch.Tensor) -> torch.Tensor:
        """[B, Lt + 1 + N, H] last hidden states of an image forward (text, image start, patches)."""
        b, c, h, w = x.shape
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"latents {h}x{w} are not a multiple of the patch size {p}")
        embed = self.lm.get_input_embeddings()
        dtype = embed.weight.dtype
        rows, cols = h // p, w // p
        patches = x.reshape(b, c, rows, p, cols, p).permute(0, 2, 4, 1, 3, 5).reshape(b, rows * cols, c * p * p)
        t_emb = self.time_embed(timestep_features(sigma).to(dtype))  # [B, H]
        image = self.patch_embed(patches.to(dtype)) + sincos_2d(rows, cols, t_emb.shape[-1], x.device).to(dtype)
        image = image + t_emb[:, None]
        start = (self.image_start.to(dtype) + t_emb)[:, None]
        hidden = torch.cat([embed(text_ids), start, image], dim=1)
        num_image = rows * cols + 1
        mask = unified_attention_mask(text_mask, num_image, dtype)
        valid = text_mask.long()
        text_pos = (valid.cumsum(-1) - 1).clamp_min(0)
        image_pos = valid.sum(-1, keepdim=True) + torch.arange(num_image, device=x.device)[None]
        positions = torch.cat([text_pos, image_pos], dim=1)
        return self.lm.model(inputs_embeds=hidden, attention_mask=mask, position_ids=positions,
                             use_cache=False).last_hidden_state

    # ---------------------------------------------------------------- folders
    def image_config(self) -> dict[str, int]:
        return {"latent_channels": self.latent_channels, "patch_size": self.patch_size,
                "vae_scale_factor": self.vae_scale_factor}

    def save_pretrained(self, directory: str) -> str:
        """``<directory>/lm`` (the backbone, ``AutoModelForCausalLM`` loads it), ``image_heads.safetensors`` and
        ``unified_config.json``; ``UnifiedTransformer.from_pretrained(directory)`` reads them back."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        self.lm.save_pretrained(os.path.join(directory, LM_DIR))
        heads = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items() if not k.startswith("lm.")}
        save_file(heads, os.path.join(directory, HEADS_FILE))
        with open(os.path.join(directory, UNIFIED_CONFIG), "w") as f:
            json.dump(self.image_config(), f, indent=1)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str, *, dtype: torch.dtype = torch.float32,
                        attn_implementation: str = "sdpa") -> "UnifiedTransformer":
        """The module ``save_pretrained`` wrote (local files only); every weight must be in the folder."""
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        with open(os.path.join(directory, UNIFIED_CONFIG)) as f:
            shape = json.load(f)
        lm = AutoModelForCausalLM.from_pretrained(os.path.join(directory, LM_DIR), dtype=dtype, local_files_only=True,
                                                  attn_implementation=attn_implementation)
        module = cls(lm, **{k: int(shape[k]) for k in ("latent_channels", "patch_size", "vae_scale_factor")}).to(dtype)
        missing, unexpected = module.load_state_dict(load_file(os.path.join(directory, HEADS_FILE)), strict=False)
        missing = [k for k in missing if not k.startswith("lm.")]
        if missing or unexpected:
            raise ValueError(f"{directory}/{HEADS_FILE} does not fit this model: missing {missing}, unexpected {unexpected}")
        return module.eval()
