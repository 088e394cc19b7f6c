"""``QwenImagePipeline``: Flow-GRPO SDE sampling and exact log-prob recomputation for Qwen-Image.

The SDE, its log-prob and the sampling variants (SDE window, shared initial noise) are
``unirl_ray.models.flow_sde``, shared with SD3, FLUX and the video family; this module holds what is particular to
Qwen-Image: latents packed 2 x 2 into tokens around every transformer call (the SDE state stays ``[C, h, w]``),
the text conditioning (the Qwen2.5-VL encoder's last hidden state over Qwen-Image's prompt template, its system
turn dropped, padded to ``max_sequence_length`` with a mask so that samples of different prompts batch
together; the transformer attends to the unmasked tokens only, so the padding changes nothing), true
classifier-free guidance with the model card's negative prompt (``" "``) and Qwen-Image's rescale of the guided
velocity to the norm of the conditional one, its sigma schedule (``linspace(1, 1/T, T)`` with the exponential
shift by the image's token count) and the VAE's per-channel latent normalisation.

Shapes: ``B`` batch, ``T`` steps, ``latent_shape`` = ``[C, h, w]`` (``h = H / vae_scale_factor``, even).
"""

from __future__ import annotations

import numpy as np
import torch

from unirl_ray.config.checks import PositiveInt
from unirl_ray.models.flow_sde import FlowSDEPipeline, GuidanceScale, NoiseLevel, to_uint8, vae_latent_stats
from unirl_ray.models.flux.pipeline import pack, unpack
from unirl_ray.models.qwen_image.bundle import QwenImageBundle
from unirl_ray.models.qwen_image.config import PACK

NEGATIVE_PROMPT = " "
"""The negative prompt of true CFG (the Qwen-Image model card's; the diffusers pipeline runs no CFG without one)."""


class QwenImagePipeline(FlowSDEPipeline):
    """Flow-GRPO sampling / recomputation around a ``QwenImageBundle`` (see ``unirl_ray.models.flow_sde``)."""

    def __init__(
        self,
        bundle: QwenImageBundle,
        *,
        num_inference_steps: PositiveInt = 10,
        height: int = 512,
        width: int = 512,
        guidance_scale: GuidanceScale = 4.0,
        noise_level: NoiseLevel = 0.7,
        max_sequence_length: PositiveInt = 128,
        sde_window_size: int | None = None,
        sde_window_range: list[int] | tuple[int, int] | None = None,
        share_initial_noise: bool = False,
    ) -> None:
        """
        Args:
            num_inference_steps: Denoising steps T per trajectory.
            height: Image height in pixels (a multiple of ``vae_scale_factor x 2``: 16 for Qwen-Image).
            width: Image width in pixels (a multiple of ``vae_scale_factor x 2``).
            guidance_scale: True classifier-free guidance against the negative prompt ``" "`` (two transformer
                passes per step, the guided velocity rescaled to the conditional one's norm); 4.0 is the model
                card's value, 1 disables it.
            noise_level: Flow-GRPO SDE noise scale eta of the SDE steps (> 0).
            max_sequence_length: Prompt tokens after the template's system turn (up to 1024); every prompt is
                padded to it (masked), so longer prompts are cut there.
            sde_window_size: SDE steps per trajectory; the others are ODE steps recorded with log-prob NaN
                (see ``SD3Pipeline``); None: every step is an SDE step.
            sde_window_range: ``[lo, hi)`` the window may cover; None: every step.
            share_initial_noise: The samples of a group start from the same initial noise.
        """
        self.height, self.width = height, width
        super().__init__(
            bundle, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, noise_level=noise_level,
            max_sequence_length=max_sequence_length, sde_window_size=sde_window_size,
            sde_window_range=sde_window_range, share_initial_noise=share_initial_noise)

    # ------------------------------------------------------------------ setup
    def validate_shape(self) -> None:
        """Raise ``ValueError`` unless height and width are multiples of ``vae_scale_factor x 2``."""
        self.bundle.config.validate_resolution(self.height, self.width)
        if self.max_sequence_length > 1024:
            raise ValueError(f"pipeline.max_sequence_length must be <= 1024 (Qwen-Image's limit), got {self.max_sequence_length}")
        if self.bundle.transformer.config.get("guidance_embeds", False):
            raise ValueError("this Qwen-Image transformer is guidance-distilled (guidance_embeds=true), which "
                             "QwenImagePipeline does not drive; use a model without distilled guidance (Qwen-Image)")

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.bundle.vae.config.temperal_downsample)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape ``(C, h, w)`` (unpacked)."""
        f = self.vae_scale_factor
        return (int(self.bundle.vae.config.z_dim), self.height // f, self.width // f)

    @property
    def image_tokens(self) -> int:
        """Packed image tokens the transformer sees: ``(h/2)(w/2)``."""
        _, h, w = self.latent_shape
        return (h // PACK) * (w // PACK)

    def _compute_sigmas(self) -> torch.Tensor:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        sched = self._euler_scheduler()
        n, cfg = self.num_inference_steps, sched.config
        mu = calculate_shift(self.image_tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        return self._schedule_sigmas(sched, sigmas=np.linspace(1.0, 1.0 / n, n).tolist(), mu=float(mu))

    # ------------------------------------------------------------------ conditioning
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """``prompt_embeds`` [B, L, D] and ``prompt_mask`` [B, L] (1 = a prompt token) with L =
        ``max_sequence_length``, on the bundle's device; with CFG also ``negative_prompt_embeds`` /
        ``negative_prompt_mask`` of the negative prompt."""
        pipe = self.bundle.diffusers_pipeline()
        length = self.max_sequence_length

        def encode(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
            embeds, mask = pipe.encode_prompt(prompt=texts, device=self.bundle.device, max_sequence_length=length)
            b, n, _ = embeds.shape
            mask = torch.ones(b, n, dtype=torch.long, device=embeds.device) if mask is None else mask.long()
            pad = length - n
            return (torch.nn.functional.pad(embeds, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad)))

        embeds, mask = encode(list(prompts))
        cond = {"prompt_embeds": embeds, "prompt_mask": mask}
        if self.do_cfg:
            neg, neg_mask = encode([NEGATIVE_PROMPT] * len(prompts))
            cond.update(negative_prompt_embeds=neg, negative_prompt_mask=neg_mask)
        return cond

    def _cond_keys(self) -> tuple[str, ...]:
        base = ("prompt_embeds", "prompt_mask")
        return base + ("negative_prompt_embeds", "negative_prompt_mask") if self.do_cfg else base

    # ------------------------------------------------------------------ model
    def _velocity(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Velocity [B, C, h, w] (float32) at latents ``x`` [B, C, h, w] and noise levels ``sigma`` [B]: the
        latents go in packed; with CFG the negative and conditional halves run as one batch and the guided
        velocity is rescaled per token to the conditional one's norm (as ``diffusers.QwenImagePipeline``)."""
        dtype = self.bundle.dtype
        _, _, h, w = x.shape
        embeds, mask = cond["prompt_embeds"], cond["prompt_mask"]
        if self.do_cfg:
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            mask = torch.cat([cond["negative_prompt_mask"], mask])
        out = module(
            hidden_states=pack(x).to(dtype),
            timestep=sigma.to(dtype),
            encoder_hidden_states=embeds.to(dtype),
            encoder_hidden_states_mask=mask.bool(),
            img_shapes=[[(1, h // PACK, w // PACK)]] * x.shape[0],
            return_dict=False,
        )[0].float()
        if self.do_cfg:
            uncond, text = out.chunk(2)
            guided = uncond + self.guidance_scale * (text - uncond)
            out = guided * (text.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
        return unpack(out, h, w)

    def _latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel VAE latent mean and std, [1, C, 1, 1] float32 on the bundle's device."""
        return vae_latent_stats(self.bundle.vae, self.bundle.device, 4)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, h, w] -> [B, H, W, 3] uint8 images (the VAE decodes them as one-frame videos)."""
        vae = self.bundle.vae
        mean, std = self._latent_stats()
        z = latents.to(device=self.bundle.device, dtype=torch.float32) * std + mean
        image = vae.decode(z[:, :, None].to(vae.dtype), return_dict=False)[0][:, :, 0]  # [B, 3, H, W] in [-1, 1]
        return to_uint8(image).permute(0, 2, 3, 1).cpu().numpy()

    # ------------------------------------------------------------------ training
    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> float32 latents [B, *latent_shape], the inverse of ``decode``."""
        raw = self._vae_latents(pixels[:, :, None], generators)[:, :, 0]
        mean, std = self._latent_stats()
        return (raw.float().to(mean.device) - mean) / std
