"""``SD3Pipeline``: Flow-GRPO SDE sampling and exact log-prob recomputation for SD3.

The SDE, its log-prob and the sampling variants (SDE window, shared initial noise, CFG) are
``unirl_ray.models.flow_sde``, shared with the video family; this module holds what is particular
to SD3: the resolution check, the (dynamically shifted) sigma schedule, the three-encoder prompt
conditioning, the transformer call and VAE decoding / encoding of images.

Shapes: ``B`` batch, ``T`` steps, ``latent_shape`` = ``[C, h, w]`` (``h = H / vae_scale_factor``).
"""

from __future__ import annotations

import numpy as np
import torch

from unirl_ray.config.checks import PositiveInt
from unirl_ray.models.flow_sde import (  # noqa: F401  (re-exported: the SDE math's historical home)
    MIN_STD,
    FlowSDEPipeline,
    GuidanceScale,
    NoiseLevel,
    decode_image_latents,
    gaussian_log_prob,
    scale_image_latents,
    sde_step_stats,
    to_uint8,
)
from unirl_ray.models.sd3.bundle import SD3Bundle


class SD3Pipeline(FlowSDEPipeline):
    """Flow-GRPO sampling / recomputation around an ``SD3Bundle`` (see ``unirl_ray.models.flow_sde``)."""

    def __init__(
        self,
        bundle: SD3Bundle,
        *,
        num_inference_steps: PositiveInt = 10,
        height: int = 512,
        width: int = 512,
        guidance_scale: GuidanceScale = 1.0,
        noise_level: NoiseLevel = 0.7,
        max_sequence_length: PositiveInt = 77,
        sde_window_size: int | None = None,
        sde_window_range: list[int] | tuple[int, int] | None = None,
        share_initial_noise: bool = False,
    ) -> None:
        """
        Args:
            num_inference_steps: Denoising steps T per trajectory.
            height: Image height in pixels (a multiple of the model's latent factor).
            width: Image width in pixels (a multiple of the model's latent factor).
            guidance_scale: Classifier-free guidance weight; 1 disables CFG (no negative prompt pass).
            noise_level: Flow-GRPO SDE noise scale eta of the SDE steps (> 0).
            max_sequence_length: T5 prompt tokens.
            sde_window_size: SDE steps per trajectory (MixGRPO / Flow-GRPO-Fast); the other steps are
                deterministic ODE steps that are recorded with log-prob NaN and never trained; 0
                samples with the ODE only (DiffusionNFT); None: every step is an SDE step.
            sde_window_range: ``[lo, hi)``: step indices the window may cover; its start is drawn
                uniformly in ``[lo, hi - sde_window_size]`` per sample from the sample's seed
                (``hi - lo == sde_window_size`` fixes it); None: ``[0, num_inference_steps)``.
            share_initial_noise: DanceGRPO: the samples of a group start from the same initial noise
                (drawn from the group's seed); per-step SDE noise still differs. Callers pass ``group_seeds``.
        """
        self.height = height
        self.width = width
        super().__init__(
            bundle,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            noise_level=noise_level,
            max_sequence_length=max_sequence_length,
            sde_window_size=sde_window_size,
            sde_window_range=sde_window_range,
            share_initial_noise=share_initial_noise,
        )

    # ------------------------------------------------------------------ setup
    def validate_shape(self) -> None:
        """Raise ``ValueError`` unless height and width are multiples of the model's latent factor."""
        self.bundle.config.validate_resolution(self.height, self.width)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.bundle.vae.config.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape ``(C, h, w)``."""
        f = self.vae_scale_factor
        return (int(self.bundle.vae.config.latent_channels), self.height // f, self.width // f)

    def _compute_sigmas(self) -> torch.Tensor:
        sched = self._euler_scheduler()
        kwargs = {}
        if sched.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self._dynamic_shift_mu(sched.config)
        return self._schedule_sigmas(sched, **kwargs)

    def _dynamic_shift_mu(self, cfg) -> float:
        """Resolution-dependent shift: linear in the image token count between base and max shift."""
        patch = int(self.bundle.config.latent_factor() // self.vae_scale_factor)
        seq_len = (self.latent_shape[1] // patch) * (self.latent_shape[2] // patch)
        base_len, max_len = cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096)
        base_shift, max_shift = cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16)
        slope = (max_shift - base_shift) / (max_len - base_len)
        return float(base_shift + slope * (seq_len - base_len))

    # ------------------------------------------------------------------ conditioning
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text conditioning on the bundle's device.

        Returns ``prompt_embeds`` [B, L, D] and ``pooled`` [B, P]; with CFG also
        ``negative_prompt_embeds`` [B, L, D] and ``negative_pooled`` [B, P] (empty negative prompt).
        """
        pe, neg_pe, pooled, neg_pooled = self.bundle.diffusers_pipeline().encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.bundle.device,
            do_classifier_free_guidance=self.do_cfg,
            max_sequence_length=self.max_sequence_length,
        )
        cond = {"prompt_embeds": pe, "pooled": pooled}
        if self.do_cfg:
            cond.update(negative_prompt_embeds=neg_pe, negative_pooled=neg_pooled)
        return cond

    def _cond_keys(self) -> tuple[str, ...]:
        base = ("prompt_embeds", "pooled")
        return base + ("negative_prompt_embeds", "negative_pooled") if self.do_cfg else base

    # ------------------------------------------------------------------ model
    def _velocity(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Guided velocity [B, ...] (float32) at latents ``x`` [B, ...] and noise levels ``sigma`` [B]."""
        dtype = self.bundle.dtype
        t = sigma * self.num_train_timesteps
        pe, pooled = cond["prompt_embeds"], cond["pooled"]
        if self.do_cfg:
            x, t = torch.cat([x, x]), torch.cat([t, t])
            pe = torch.cat([cond["negative_prompt_embeds"], pe])
            pooled = torch.cat([cond["negative_pooled"], pooled])
        out = module(
            hidden_states=x.to(dtype),
            timestep=t,
            encoder_hidden_states=pe.to(dtype),
            pooled_projections=pooled.to(dtype),
            return_dict=False,
        )[0]
        return self._guide(out)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, h, w] -> [B, H, W, 3] uint8 images."""
        return decode_image_latents(self.bundle.vae, latents, self.bundle.device)

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def encode_images(
        self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None
    ) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> float32 latents [B, *latent_shape], the inverse of ``decode``:
        a sample of the VAE posterior (one CPU generator per image; its mode without), shifted and scaled.

        Supervised flow matching (``unirl_ray.algorithms.SFT``) noises these clean latents.
        """
        return scale_image_latents(self.bundle.vae, self._vae_latents(pixels, generators))
