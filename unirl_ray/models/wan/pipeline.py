"""``WanPipeline``: Flow-GRPO SDE sampling and exact log-prob recomputation for Wan text-to-video.

The SDE, its log-prob and the sampling variants (SDE window, shared initial noise, CFG) are
``unirl_ray.models.flow_sde``, shared with SD3: a video latent is one more axis that per-sample
scalars broadcast over, and the log-prob is still the mean over all latent elements. This module
holds what is particular to Wan: the clip-shape check against the VAE's temporal / spatial factors,
the shifted flow-matching schedule, UMT5 prompt conditioning, the 3D transformer call and video
decoding with the VAE's per-channel latent statistics.

Shapes: ``B`` batch, ``T`` steps, ``latent_shape`` = ``[C, f, h, w]`` with ``f = (F - 1) / temporal + 1``
latent frames and ``h = H / spatial``; decoded media are uint8 frames ``[F, H, W, 3]`` per sample.
"""

from __future__ import annotations

import numpy as np
import torch

from unirl_ray.config.checks import PositiveInt
from unirl_ray.models.flow_sde import FlowSDEPipeline, GuidanceScale, NoiseLevel, to_uint8, vae_latent_stats
from unirl_ray.models.wan.bundle import WanBundle


class WanPipeline(FlowSDEPipeline):
    """Flow-GRPO sampling / recomputation around a ``WanBundle`` (see ``unirl_ray.models.flow_sde``)."""

    def __init__(
        self,
        bundle: WanBundle,
        *,
        num_inference_steps: PositiveInt = 10,
        num_frames: int = 33,
        height: int = 480,
        width: int = 832,
        fps: int = 16,
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
            num_frames: Frames F per video: 1 + a multiple of the VAE's temporal factor (Wan2.1: 4).
            height: Frame height in pixels (a multiple of the VAE spatial factor x patch size; Wan2.1: 16).
            width: Frame width in pixels (same rule as ``height``).
            fps: Frames per second of the videos (logged GIFs play at this rate).
            guidance_scale: Classifier-free guidance weight; 1 disables CFG (no negative prompt pass).
            noise_level: Flow-GRPO SDE noise scale eta of the SDE steps (> 0).
            max_sequence_length: UMT5 prompt tokens (Wan2.1 was trained with 512).
            sde_window_size: SDE steps per trajectory (MixGRPO / Flow-GRPO-Fast); the other steps are
                deterministic ODE steps recorded with log-prob NaN and never trained; 0 samples with the
                ODE only; None: every step is an SDE step.
            sde_window_range: ``[lo, hi)``: step indices the window may cover; its start is drawn per sample
                from the sample's seed in ``[lo, hi - sde_window_size]``; None: ``[0, num_inference_steps)``.
            share_initial_noise: DanceGRPO: the samples of a group start from the same initial noise.
        """
        self.num_frames = num_frames
        self.height = height
        self.width = width
        self.fps = fps
        self.geometry = bundle.config.geometry()
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
        """Raise ``ValueError`` unless frames / height / width fit the VAE factors and the patch size."""
        self.bundle.config.validate_video(self.num_frames, self.height, self.width)
        if not self.fps >= 1:
            raise ValueError(f"fps must be >= 1, got {self.fps}")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape ``(C, f, h, w)``."""
        g = self.geometry
        return (g.latent_channels, g.latent_frames(self.num_frames), self.height // g.spatial, self.width // g.spatial)

    def _compute_sigmas(self) -> torch.Tensor:
        """Shifted flow-matching sigmas; a non-Euler checkpoint scheduler (Wan2.1 ships UniPC) gives its
        ``flow_shift`` and ``num_train_timesteps`` to an Euler schedule (the SDE needs plain sigmas)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        cfg = self.bundle.scheduler.config
        if isinstance(self.bundle.scheduler, FlowMatchEulerDiscreteScheduler):
            sched = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        else:
            shift = float(cfg.get("flow_shift", None) or cfg.get("shift", None) or 1.0)
            sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.num_train_timesteps, shift=shift)
        return self._schedule_sigmas(sched)

    # ------------------------------------------------------------------ conditioning
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text conditioning on the bundle's device: ``prompt_embeds`` [B, L, D] (zero-padded past each
        prompt's tokens); with CFG also ``negative_prompt_embeds`` [B, L, D] (empty negative prompt)."""
        pe, neg = self.bundle.diffusers_pipeline().encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=self.do_cfg,
            max_sequence_length=self.max_sequence_length,
            device=self.bundle.device,
            dtype=self.bundle.dtype,
        )
        cond = {"prompt_embeds": pe}
        if self.do_cfg:
            cond["negative_prompt_embeds"] = neg
        return cond

    def _cond_keys(self) -> tuple[str, ...]:
        return ("prompt_embeds", "negative_prompt_embeds") if self.do_cfg else ("prompt_embeds",)

    # ------------------------------------------------------------------ model
    def _velocity(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Guided velocity [B, C, f, h, w] (float32) at latents ``x`` and noise levels ``sigma`` [B]."""
        dtype = self.bundle.dtype
        t = sigma * self.num_train_timesteps
        pe = cond["prompt_embeds"]
        if self.do_cfg:
            x, t = torch.cat([x, x]), torch.cat([t, t])
            pe = torch.cat([cond["negative_prompt_embeds"], pe])
        out = module(hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=pe.to(dtype), return_dict=False)[0]
        return self._guide(out)

    def _latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel VAE latent mean and std, [1, C, 1, 1, 1] float32 on the bundle's device."""
        return vae_latent_stats(self.bundle.vae, self.bundle.device, 5)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, f, h, w] -> [B, F, H, W, 3] uint8 frames."""
        vae = self.bundle.vae
        mean, std = self._latent_stats()
        z = latents.to(device=self.bundle.device, dtype=torch.float32) * std + mean
        video = vae.decode(z.to(vae.dtype), return_dict=False)[0]  # [B, 3, F, H, W] in [-1, 1]
        return to_uint8(video).permute(0, 2, 3, 4, 1).cpu().numpy()

    @torch.no_grad()
    def encode_videos(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """Videos [B, 3, F, H, W] in [-1, 1] -> float32 latents [B, *latent_shape], the inverse of ``decode``:
        a sample of the VAE posterior (one CPU generator per video; its mode without), normalised."""
        z = self._vae_latents(pixels, generators)
        mean, std = self._latent_stats()
        return (z.float() - mean) / std
