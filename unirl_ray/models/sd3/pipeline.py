"""``SD3Pipeline``: Flow-GRPO SDE sampling and exact log-prob recomputation for SD3.

Flow matching integrates the ODE ``dx = v(x, sigma) dsigma`` from ``sigma = 1`` (noise) to ``0``.
Flow-GRPO turns each Euler step into a Gaussian transition with the same marginals (an SDE),
so that every step has a log-likelihood under the policy:

    dt      = sigma_next - sigma                       (< 0)
    std_t   = noise_level * sqrt(sigma / (1 - sigma'))  sigma' = sigma, except sigma == 1 -> sigmas[1]
    mean    = x * (1 + std_t^2 / (2 sigma) * dt) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt
    x_next  = mean + std_t * sqrt(-dt) * eps,  eps ~ N(0, I)

The log-prob of a transition is the Gaussian log-density of ``x_next`` under
``N(mean, (std_t sqrt(-dt))^2 I)`` averaged over all non-batch elements. Sampling and
``step_log_prob`` share the same functions, so before any update the recomputed log-prob equals the
recorded one up to float rounding. All SDE math runs in float32; the transformer runs in the
bundle's dtype.

Shapes: ``B`` batch, ``T`` steps, ``latent_shape`` = ``[C, h, w]`` (``h = H / vae_scale_factor``);
per-sample scalars are ``[B]`` and broadcast over the latent axes (a video time axis would just be
one more latent axis).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from unirl_ray.core.sample import DiffusionPart
from unirl_ray.models.sd3.bundle import SD3Bundle

MIN_STD = 1e-6
"""Lower clamp of the transition std (keeps log-probs finite on degenerate schedules)."""
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_TRAJ_KEYS = ("latents", "log_probs", "sigmas")


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] broadcastable against ``like`` [B, ...]."""
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def sde_step_stats(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_second: torch.Tensor,
    noise_level: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [B, ...] and std [B] of the Flow-GRPO transition from ``x`` at ``sigma`` to ``sigma_next``.

    ``x``, ``v``: [B, ...] latents and predicted velocity (float32); ``sigma``, ``sigma_next``,
    ``sigma_second``: [B] (``sigma_second`` = the schedule's second sigma, used instead of
    ``sigma`` in the ``1 - sigma`` denominator when ``sigma == 1``).
    """
    dt = sigma_next - sigma
    sigma_safe = sigma.clamp_min(MIN_STD)
    sigma_den = torch.where(sigma >= 1, sigma_second, sigma)
    std_t = noise_level * torch.sqrt(sigma_safe / (1 - sigma_den).clamp_min(MIN_STD))
    x_coef = 1 + std_t**2 / (2 * sigma_safe) * dt
    v_coef = (1 + std_t**2 * (1 - sigma) / (2 * sigma_safe)) * dt
    mean = x * _bcast(x_coef, x) + v * _bcast(v_coef, v)
    std = (std_t * torch.sqrt((-dt).clamp_min(0))).clamp_min(MIN_STD)
    return mean, std


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of ``x`` [B, ...] under N(mean, std^2) (std [B]), averaged over non-batch axes -> [B]."""
    s = _bcast(std, x)
    lp = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - _LOG_SQRT_2PI
    return lp.flatten(1).mean(dim=1)


def _module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


class SD3Pipeline:
    """Flow-GRPO sampling / recomputation around an ``SD3Bundle`` (see the module docstring)."""

    def __init__(
        self,
        bundle: SD3Bundle,
        *,
        num_inference_steps: int = 10,
        height: int = 512,
        width: int = 512,
        guidance_scale: float = 1.0,
        noise_level: float = 0.7,
        max_sequence_length: int = 77,
    ) -> None:
        self.bundle = bundle
        self.num_inference_steps = num_inference_steps
        self.height = height
        self.width = width
        self.guidance_scale = guidance_scale
        self.noise_level = noise_level
        self.max_sequence_length = max_sequence_length
        self.validate()
        self.num_train_timesteps = int(bundle.scheduler.config.get("num_train_timesteps", 1000))
        self._sigmas = self._compute_sigmas()

    # ------------------------------------------------------------------ setup
    def validate(self) -> None:
        """Raise ``ValueError`` with a fix for bad resolution / steps / noise / guidance settings."""
        self.bundle.config.validate_resolution(self.height, self.width)
        if self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if not self.noise_level > 0:
            raise ValueError(f"noise_level must be > 0 (SDE sampling needs noise), got {self.noise_level}")
        if self.guidance_scale < 1:
            raise ValueError(f"guidance_scale must be >= 1 (1 disables CFG), got {self.guidance_scale}")
        if self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")

    @property
    def do_cfg(self) -> bool:
        """Whether classifier-free guidance is used (``guidance_scale > 1``)."""
        return self.guidance_scale > 1.0

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.bundle.vae.config.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape ``(C, h, w)``."""
        f = self.vae_scale_factor
        return (int(self.bundle.vae.config.latent_channels), self.height // f, self.width // f)

    @property
    def sigmas(self) -> torch.Tensor:
        """[T+1] float32 CPU schedule, sigmas[0] = 1 ... sigmas[T] = 0."""
        return self._sigmas

    def _compute_sigmas(self) -> torch.Tensor:
        sched = FlowMatchEulerDiscreteScheduler.from_config(self.bundle.scheduler.config)
        kwargs = {}
        if sched.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self._dynamic_shift_mu(sched.config)
        sched.set_timesteps(self.num_inference_steps, device="cpu", **kwargs)
        return sched.sigmas.detach().to(torch.float32).cpu().clone()

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
        )[0].float()
        if self.do_cfg:
            uncond, text = out.chunk(2)
            out = uncond + self.guidance_scale * (text - uncond)
        return out

    def _sde_stats(
        self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transition stats for rows of ``sigmas`` [B, T+1] at step indices ``idx`` [B]."""
        rows = torch.arange(sigmas.shape[0], device=sigmas.device)
        return sde_step_stats(
            x, v, sigmas[rows, idx], sigmas[rows, idx + 1], sigmas[:, 1], self.noise_level
        )

    # ------------------------------------------------------------------ sampling
    def _noise(self, generators: list[torch.Generator]) -> torch.Tensor:
        """[B, *latent_shape] float32 CPU noise, one generator per sample."""
        return torch.stack([torch.randn(self.latent_shape, generator=g) for g in generators])

    @torch.no_grad()
    def sample(
        self, prompts: list[str], seeds: list[int], *, module: torch.nn.Module | None = None
    ) -> list[tuple[DiffusionPart, np.ndarray]]:
        """Sample one image per prompt with the Flow-GRPO SDE; returns (trajectory part, [H, W, 3] uint8).

        ``module`` is the transformer to call (default ``bundle.transformer``; train workers pass
        their FSDP2-wrapped one). Sample ``i`` draws its initial and per-step noise from a CPU
        generator seeded with ``seeds[i]``, so it does not depend on the batch it is drawn in.
        """
        if len(prompts) != len(seeds):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        if not prompts:
            return []
        module = self.bundle.transformer if module is None else module
        device = _module_device(module)
        cond = {k: v.to(device) for k, v in self.encode_prompts(prompts).items()}
        b, steps = len(prompts), self.num_inference_steps
        sigmas = self._sigmas.to(device).expand(b, -1)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        x = self._noise(gens).to(device)
        traj, logps = [x], []
        for i in range(steps):
            idx = torch.full((b,), i, dtype=torch.long, device=device)
            v = self._velocity(module, x, sigmas[:, i], cond)
            mean, std = self._sde_stats(x, v, sigmas, idx)
            x = mean + _bcast(std, mean) * self._noise(gens).to(device)
            logps.append(gaussian_log_prob(x, mean, std))
            traj.append(x)
        images = self.decode(x)
        latents = torch.stack(traj, dim=1).cpu()
        log_probs = torch.stack(logps, dim=1).cpu()
        out = []
        for i in range(b):
            part = DiffusionPart(
                latents=latents[i].clone(),
                log_probs=log_probs[i].clone(),
                sigmas=self._sigmas.clone(),
                cond={k: v[i].detach().cpu().clone() for k, v in cond.items()},
            )
            out.append((part, images[i]))
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, C, h, w] -> [B, H, W, 3] uint8 images."""
        vae = self.bundle.vae
        shift = vae.config.get("shift_factor", None) or 0.0
        z = latents / vae.config.scaling_factor + shift
        img = vae.decode(z.to(device=self.bundle.device, dtype=vae.dtype), return_dict=False)[0]
        img = (img.float() / 2 + 0.5).clamp(0, 1)
        return (img * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    # ------------------------------------------------------------------ training
    def collate(self, parts: list[DiffusionPart]) -> dict[str, torch.Tensor]:
        """Stack parts: ``latents`` [B, T+1, ...], ``log_probs`` [B, T], ``sigmas`` [B, T+1], cond [B, ...]."""
        if not parts:
            raise ValueError("collate needs at least one DiffusionPart")
        if any(p.is_light for p in parts):
            raise ValueError("collate got a light DiffusionPart (no trajectory); use the full sample from the cache")
        shapes = {tuple(p.latents.shape) for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"parts have different trajectory shapes {sorted(shapes)}; batch equal-size samples")
        batch = {k: torch.stack([getattr(p, k) for p in parts]) for k in _TRAJ_KEYS}
        missing = [k for k in self._cond_keys() if any(k not in p.cond for p in parts)]
        if missing:
            raise ValueError(f"parts lack conditioning {missing}; were they sampled with another guidance_scale?")
        for k in self._cond_keys():
            batch[k] = torch.stack([p.cond[k] for p in parts])
        return batch

    def step_log_prob(
        self, module: torch.nn.Module, batch: dict[str, torch.Tensor], step_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recompute transition ``latents[b, j] -> latents[b, j + 1]`` (``j = step_index[b]``) with grad.

        ``batch`` comes from ``collate``; ``step_index`` is a LongTensor [B] (may differ per sample).
        Returns ``(log_prob [B], mean [B, *latent_shape], std [B])`` on the module's device.
        """
        device = _module_device(module)
        latents = batch["latents"].to(device)
        steps = latents.shape[1] - 1
        idx = step_index.to(device=device, dtype=torch.long)
        if idx.shape != (latents.shape[0],) or bool((idx < 0).any()) or bool((idx >= steps).any()):
            raise ValueError(f"step_index must be [B={latents.shape[0]}] with values in [0, {steps}), got {step_index}")
        rows = torch.arange(latents.shape[0], device=device)
        x, x_next = latents[rows, idx], latents[rows, idx + 1]
        sigmas = batch["sigmas"].to(device)
        cond = {k: batch[k].to(device) for k in self._cond_keys()}
        v = self._velocity(module, x, sigmas[rows, idx], cond)
        mean, std = self._sde_stats(x, v, sigmas, idx)
        return gaussian_log_prob(x_next, mean, std), mean, std
