"""``FluxPipeline``: Flow-GRPO SDE sampling and exact log-prob recomputation for FLUX.

The SDE, its log-prob and the sampling variants (SDE window, shared initial noise, CFG) are
``unirl_ray.models.flow_sde``, shared with SD3 and the video family; this module holds what is particular to
FLUX: latents packed 2 x 2 into tokens around every transformer call (the SDE state stays ``[C, h, w]``), the
rotary position ids of image and text tokens, FLUX.1-dev's distilled guidance (an input of the transformer,
``guidance``; true classifier-free guidance with an empty negative prompt stays available as
``guidance_scale`` > 1), its sigma schedule (``linspace(1, 1/T, T)`` shifted by the image's token count), the
CLIP-pooled + T5 conditioning and VAE decoding / encoding.

Shapes: ``B`` batch, ``T`` steps, ``latent_shape`` = ``[C, h, w]`` (``h = H / vae_scale_factor``, even).
"""

from __future__ import annotations

import numpy as np
import torch

from unirl_ray.config.checks import PositiveInt
from unirl_ray.models.flow_sde import (
    FlowSDEPipeline,
    GuidanceScale,
    NoiseLevel,
    decode_image_latents,
    scale_image_latents,
)
from unirl_ray.models.flux.bundle import FluxBundle
from unirl_ray.models.flux.config import PACK


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]`` tokens (the layout of ``diffusers.FluxPipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PACK, PACK, w // PACK, PACK).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PACK) * (w // PACK), c * PACK * PACK)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The inverse of ``pack``: ``[B, (h/2)(w/2), 4C]`` -> ``[B, C, h, w]``."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // PACK, w // PACK, d // (PACK * PACK), PACK, PACK).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // (PACK * PACK), h, w)


class FluxPipeline(FlowSDEPipeline):
    """Flow-GRPO sampling / recomputation around a ``FluxBundle`` (see ``unirl_ray.models.flow_sde``)."""

    def __init__(
        self,
        bundle: FluxBundle,
        *,
        num_inference_steps: PositiveInt = 10,
        height: int = 512,
        width: int = 512,
        guidance: float = 3.5,
        guidance_scale: GuidanceScale = 1.0,
        noise_level: NoiseLevel = 0.7,
        max_sequence_length: PositiveInt = 512,
        sde_window_size: int | None = None,
        sde_window_range: list[int] | tuple[int, int] | None = None,
        share_initial_noise: bool = False,
    ) -> None:
        """
        Args:
            num_inference_steps: Denoising steps T per trajectory.
            height: Image height in pixels (a multiple of ``vae_scale_factor x 2``).
            width: Image width in pixels (a multiple of ``vae_scale_factor x 2``).
            guidance: FLUX.1-dev's distilled guidance, given to the transformer as an input (3.5 is the
                model card's value); ignored by a transformer without guidance embedding (FLUX.1-schnell).
            guidance_scale: True classifier-free guidance with an empty negative prompt (two transformer
                passes); 1 disables it, as FLUX.1-dev is used.
            noise_level: Flow-GRPO SDE noise scale eta of the SDE steps (> 0).
            max_sequence_length: T5 prompt tokens (FLUX.1-dev: up to 512).
            sde_window_size: SDE steps per trajectory; the others are ODE steps recorded with log-prob NaN
                (see ``SD3Pipeline``); None: every step is an SDE step.
            sde_window_range: ``[lo, hi)`` the window may cover; None: every step.
            share_initial_noise: The samples of a group start from the same initial noise.
        """
        self.height, self.width = height, width
        self.guidance = float(guidance)
        super().__init__(
            bundle, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, noise_level=noise_level,
            max_sequence_length=max_sequence_length, sde_window_size=sde_window_size,
            sde_window_range=sde_window_range, share_initial_noise=share_initial_noise)

    # ------------------------------------------------------------------ setup
    def validate_shape(self) -> None:
        """Raise ``ValueError`` unless height and width are multiples of ``vae_scale_factor x 2``."""
        self.bundle.config.validate_resolution(self.height, self.width)
        if not self.guidance > 0:
            raise ValueError(f"pipeline.guidance must be > 0 (FLUX.1-dev uses 3.5), got {self.guidance}")

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.bundle.vae.config.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape ``(C, h, w)`` (unpacked)."""
        f = self.vae_scale_factor
        return (int(self.bundle.vae.config.latent_channels), self.height // f, self.width // f)

    @property
    def image_tokens(self) -> int:
        """Packed image tokens the transformer sees: ``(h/2)(w/2)``."""
        _, h, w = self.latent_shape
        return (h // PACK) * (w // PACK)

    def _compute_sigmas(self) -> torch.Tensor:
        sched = self._euler_scheduler()
        n = self.num_inference_steps
        kwargs = {"sigmas": np.linspace(1.0, 1.0 / n, n).tolist()}
        cfg = sched.config
        if cfg.get("use_dynamic_shifting", False):  # FLUX's shift, linear in the image's token count
            base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
            base_shift, max_shift = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15)
            slope = (max_shift - base_shift) / (max_len - base_len)
            kwargs["mu"] = float(base_shift + slope * (self.image_tokens - base_len))
        return self._schedule_sigmas(sched, **kwargs)

    # ------------------------------------------------------------------ conditioning
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [B, L, D] (T5) and ``pooled`` [B, P] (CLIP) on the bundle's device; with CFG also
        ``negative_prompt_embeds`` / ``negative_pooled`` of the empty prompt."""
        pipe = self.bundle.diffusers_pipeline()

        def encode(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
            pe, pooled, _ = pipe.encode_prompt(prompt=texts, prompt_2=None, device=self.bundle.device,
                                               max_sequence_length=self.max_sequence_length)
            return pe, pooled

        pe, pooled = encode(list(prompts))
        cond = {"prompt_embeds": pe, "pooled": pooled}
        if self.do_cfg:
            neg_pe, neg_pooled = encode([""] * len(prompts))
            cond.update(negative_prompt_embeds=neg_pe, negative_pooled=neg_pooled)
        return cond

    def _cond_keys(self) -> tuple[str, ...]:
        base = ("prompt_embeds", "pooled")
        return base + ("negative_prompt_embeds", "negative_pooled") if self.do_cfg else base

    # ------------------------------------------------------------------ model
    def _velocity(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Velocity [B, C, h, w] (float32) at latents ``x`` [B, C, h, w] and noise levels ``sigma`` [B]: the
        latents go in packed, with the image / text position ids and the distilled guidance."""
        from diffusers import FluxPipeline as DiffusersFluxPipeline

        dtype, device = self.bundle.dtype, x.device
        _, _, h, w = x.shape
        pe, pooled = cond["prompt_embeds"], cond["pooled"]
        if self.do_cfg:
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
            pe = torch.cat([cond["negative_prompt_embeds"], pe])
            pooled = torch.cat([cond["negative_pooled"], pooled])
        batch = x.shape[0]
        img_ids = DiffusersFluxPipeline._prepare_latent_image_ids(batch, h // PACK, w // PACK, device, dtype)
        txt_ids = torch.zeros(pe.shape[1], 3, device=device, dtype=dtype)
        config = getattr(module, "config", None) or self.bundle.transformer.config
        guidance = torch.full((batch,), self.guidance, device=device, dtype=torch.float32) if config.guidance_embeds else None
        out = module(
            hidden_states=pack(x).to(dtype),
            timestep=sigma.to(dtype),
            guidance=guidance,
            pooled_projections=pooled.to(dtype),
            encoder_hidden_states=pe.to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return self._guide(unpack(out, h, w))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, h, w] -> [B, H, W, 3] uint8 images."""
        return decode_image_latents(self.bundle.vae, latents, self.bundle.device)

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> float32 latents [B, *latent_shape], the inverse of ``decode``."""
        return scale_image_latents(self.bundle.vae, self._vae_latents(pixels, generators))
