"""Flow-GRPO SDE sampling shared by the flow-matching families (SD3 images, Wan videos).

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

Sampling variants (recipe options):

- SDE window (MixGRPO, Flow-GRPO-Fast): only ``sde_window_size`` consecutive steps are SDE steps;
  the others are deterministic Euler (ODE) steps ``x_next = x + v dt``, recorded with log-prob
  ``NaN`` (a deterministic transition has no density). Algorithms train only steps with a finite
  log-prob. ``sde_window_size=0`` samples the whole trajectory with the ODE (DiffusionNFT).
- Initial-noise sharing (DanceGRPO): the samples of one group start from the same noise, drawn
  from the group's seed (derived from the run seed, step and prompt); their per-step SDE noise
  still comes from their own seeds.
- CFG: ``guidance_scale > 1`` guides both sampling and recomputation; 1 disables it.

Shapes: ``B`` batch, ``T`` steps, ``latent_shape`` = ``[C, h, w]`` for images and ``[C, f, h, w]``
for videos (the time axis after the channels); per-sample scalars are ``[B]`` and broadcast over
the latent axes, so the math is the same for both. A family subclasses ``FlowSDEPipeline`` and
supplies the model-specific parts: shape checks, the sigma schedule, prompt encoding, the
transformer call and decoding.
"""

from __future__ import annotations

import abc
import math
import zlib
from typing import Annotated, Any

import numpy as np
import torch

from unirl_ray.config.checks import Bound, PositiveInt, check_choice
from unirl_ray.core.sample import DiffusionPart

NoiseLevel = Annotated[float, Bound(gt=0, why="SDE sampling needs noise")]
GuidanceScale = Annotated[float, Bound(ge=1, why="1 disables CFG")]

MIN_STD = 1e-6
"""Lower clamp of the transition std (keeps log-probs finite on degenerate schedules)."""
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_TRAJ_KEYS = ("latents", "log_probs", "sigmas")


def bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
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
    mean = x * bcast(x_coef, x) + v * bcast(v_coef, v)
    std = (std_t * torch.sqrt((-dt).clamp_min(0))).clamp_min(MIN_STD)
    return mean, std


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of ``x`` [B, ...] under N(mean, std^2) (std [B]), averaged over non-batch axes -> [B]."""
    s = bcast(std, x)
    lp = -((x - mean) ** 2) / (2 * s**2) - torch.log(s) - _LOG_SQRT_2PI
    return lp.flatten(1).mean(dim=1)


def module_device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Decoded pixels in [-1, 1] -> uint8 in [0, 255] (same layout)."""
    return ((pixels.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def decode_image_latents(vae: torch.nn.Module, latents: torch.Tensor, device: torch.device) -> np.ndarray:
    """Image latents [B, C, h, w], scaled and shifted as the SD3 / FLUX VAEs' config says, -> [B, H, W, 3] uint8."""
    shift = vae.config.get("shift_factor", None) or 0.0
    z = latents / vae.config.scaling_factor + shift
    img = vae.decode(z.to(device=device, dtype=vae.dtype), return_dict=False)[0]
    return to_uint8(img).permute(0, 2, 3, 1).cpu().numpy()


def vae_latent_stats(vae: torch.nn.Module, device: torch.device, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Wan-style VAE's per-channel latent ``latents_mean`` / ``latents_std`` as float32 [1, C, 1, ...] tensors of
    ``ndim`` dimensions on ``device`` (5 for video latents [B, C, F, h, w], 4 for image latents [B, C, h, w])."""
    shape = (1, int(vae.config.z_dim)) + (1,) * (ndim - 2)
    mean = torch.tensor(vae.config.latents_mean, dtype=torch.float32).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=torch.float32).view(shape)
    return mean.to(device), std.to(device)


def scale_image_latents(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """Raw VAE latents -> the float32 latents the model sees (the inverse of ``decode_image_latents``' scaling)."""
    shift = vae.config.get("shift_factor", None) or 0.0
    return (z.float() - shift) * vae.config.scaling_factor


class FlowSDEPipeline(abc.ABC):
    """Flow-GRPO sampling / recomputation around a family's bundle (see the module docstring).

    Subclasses set their shape attributes (height, width, ...) before calling ``__init__`` and
    implement the abstract hooks below.
    """

    def __init__(
        self,
        bundle: Any,
        *,
        num_inference_steps: PositiveInt,
        guidance_scale: GuidanceScale,
        noise_level: NoiseLevel,
        max_sequence_length: PositiveInt,
        sde_window_size: int | None,
        sde_window_range: list[int] | tuple[int, int] | None,
        share_initial_noise: bool,
    ) -> None:
        self.bundle = bundle
        self.num_inference_steps = num_inference_steps
        self.guidance_scale = guidance_scale
        self.noise_level = noise_level
        self.max_sequence_length = max_sequence_length
        self.sde_window_size = sde_window_size
        self.sde_window_range = tuple(sde_window_range) if sde_window_range is not None else None
        self.share_initial_noise = bool(share_initial_noise)
        self.validate()
        self.num_train_timesteps = int(bundle.scheduler.config.get("num_train_timesteps", 1000))
        self._sigmas = self._compute_sigmas()

    # ------------------------------------------------------------------ family hooks
    @abc.abstractmethod
    def validate_shape(self) -> None:
        """Raise ``ValueError`` with a fix when the output shape does not fit the model."""

    @property
    @abc.abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape (``(C, h, w)`` or ``(C, f, h, w)``)."""

    @abc.abstractmethod
    def _compute_sigmas(self) -> torch.Tensor:
        """[T+1] float32 CPU schedule from 1 to 0."""

    @abc.abstractmethod
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Conditioning tensors [B, ...] on the bundle's device, keyed as ``_cond_keys()``."""

    @abc.abstractmethod
    def _cond_keys(self) -> tuple[str, ...]:
        """Keys of the conditioning a trajectory carries (depends on CFG)."""

    @abc.abstractmethod
    def _velocity(
        self, module: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Guided velocity [B, ...] (float32) at latents ``x`` [B, ...] and noise levels ``sigma`` [B]."""

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Final latents [B, *latent_shape] -> uint8 media [B, ..., 3]."""

    # ------------------------------------------------------------------ helpers for the hooks
    def _euler_scheduler(self) -> Any:
        """A diffusers ``FlowMatchEulerDiscreteScheduler`` with the bundle's scheduler config (diffusers imported
        here, not with the module: a driver checks a recipe's pipeline without it)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler.from_config(self.bundle.scheduler.config)

    def _schedule_sigmas(self, scheduler: Any, **kwargs: Any) -> torch.Tensor:
        """[T+1] float32 CPU sigmas of a diffusers flow-matching ``scheduler`` set to our step count."""
        scheduler.set_timesteps(self.num_inference_steps, device="cpu", **kwargs)
        return scheduler.sigmas.detach().to(torch.float32).cpu().clone()

    def _guide(self, out: torch.Tensor) -> torch.Tensor:
        """Transformer output -> float32 velocity; with CFG ``out`` is [2B, ...] (unconditional half
        first, as the batch was doubled) and the halves are combined with ``guidance_scale``."""
        out = out.float()
        if self.do_cfg:
            uncond, text = out.chunk(2)
            out = uncond + self.guidance_scale * (text - uncond)
        return out

    def _vae_latents(self, pixels: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
        """Raw VAE latents of ``pixels`` in [-1, 1]: a posterior sample (one CPU generator per sample), or
        its mode without generators."""
        vae = self.bundle.vae
        posterior = vae.encode(pixels.to(device=self.bundle.device, dtype=vae.dtype)).latent_dist
        return posterior.mode() if generators is None else posterior.sample(generator=generators)

    # ------------------------------------------------------------------ setup
    def validate(self) -> None:
        """Raise ``ValueError`` with a fix for bad shape / steps / noise / guidance settings."""
        self.validate_shape()
        for name, annotation in (("num_inference_steps", PositiveInt), ("noise_level", NoiseLevel),
                                 ("guidance_scale", GuidanceScale), ("max_sequence_length", PositiveInt)):
            check_choice(f"pipeline.{name}", getattr(self, name), annotation)  # recipes: checked on the driver
        self._validate_sde_window()

    def _validate_sde_window(self) -> None:
        steps, size, span = self.num_inference_steps, self.sde_window_size, self.sde_window_range
        if size is None:
            if span is not None:
                raise ValueError(
                    f"sde_window_range={list(span)} needs sde_window_size (the number of SDE steps in the window); "
                    "set sde_window_size or remove sde_window_range"
                )
            return
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= steps:
            raise ValueError(
                f"sde_window_size must be an int in [0, num_inference_steps={steps}] (0: ODE only), got {size!r}"
            )
        if span is None:
            return
        if len(span) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in span):
            raise ValueError(f"sde_window_range must be two ints [lo, hi), got {list(span)!r}")
        lo, hi = span
        if not (0 <= lo < hi <= steps and hi - lo >= size):
            raise ValueError(
                f"sde_window_range=[{lo}, {hi}) must satisfy 0 <= lo < hi <= num_inference_steps={steps} and "
                f"hi - lo >= sde_window_size={size}"
            )

    @property
    def needs_group_seeds(self) -> bool:
        """Whether ``sample`` needs ``group_seeds`` (initial-noise sharing is on)."""
        return self.share_initial_noise

    @property
    def do_cfg(self) -> bool:
        """Whether classifier-free guidance is used (``guidance_scale > 1``)."""
        return self.guidance_scale > 1.0

    @property
    def sigmas(self) -> torch.Tensor:
        """[T+1] float32 CPU schedule, sigmas[0] = 1 ... sigmas[T] = 0."""
        return self._sigmas

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

    def sde_steps(self, seeds: list[int]) -> torch.Tensor:
        """[B, T] bool: which steps of each sample's trajectory are SDE steps (the rest are ODE steps).

        All steps without an SDE window; otherwise ``sde_window_size`` consecutive steps whose start
        is drawn from the sample's seed within ``sde_window_range`` (batch-independent).
        """
        steps, size = self.num_inference_steps, self.sde_window_size
        if size is None:
            return torch.ones(len(seeds), steps, dtype=torch.bool)
        lo, hi = self.sde_window_range or (0, steps)
        mask = torch.zeros(len(seeds), steps, dtype=torch.bool)
        for b, seed in enumerate(seeds):
            gen = torch.Generator().manual_seed(zlib.crc32(f"sde-window:{int(seed)}".encode()))
            start = lo + int(torch.randint(hi - size - lo + 1, (1,), generator=gen))
            mask[b, start : start + size] = True
        return mask

    def _initial_noise(self, generators: list[torch.Generator], group_seeds: list[int] | None) -> torch.Tensor:
        """[B, *latent_shape] x_0; drawn from each sample's generator (advancing it in either case),
        then replaced by the group's noise (from its group seed) when ``share_initial_noise``."""
        x = self._noise(generators)
        if not self.share_initial_noise:
            return x
        if group_seeds is None or len(group_seeds) != len(generators):
            raise ValueError(
                f"share_initial_noise=True needs group_seeds (one per prompt) in {type(self).__name__}.sample: the "
                "samples of a group share their initial noise; this caller passed none (requests carry a group_seed: "
                "pass them)"
            )
        shared = {g: torch.Generator().manual_seed(int(g)) for g in set(group_seeds)}
        noise = {g: torch.randn(self.latent_shape, generator=gen) for g, gen in shared.items()}
        return torch.stack([noise[g] for g in group_seeds])

    @torch.no_grad()
    def sample(
        self,
        prompts: list[str],
        seeds: list[int],
        *,
        module: torch.nn.Module | None = None,
        group_seeds: list[int] | None = None,
    ) -> list[tuple[DiffusionPart, np.ndarray]]:
        """Sample one output per prompt with the Flow-GRPO SDE; returns (trajectory part, uint8 media).

        The media is what ``decode`` gives per sample ([H, W, 3] images, [F, H, W, 3] video frames).
        ``module`` is the transformer to call (default ``bundle.transformer``; train workers pass
        their FSDP2-wrapped one). Sample ``i`` draws its initial and per-step noise from a CPU
        generator seeded with ``seeds[i]``, so it does not depend on the batch it is drawn in.
        ``group_seeds`` (one per prompt) are needed with ``share_initial_noise``. Steps outside the SDE
        window are Euler ODE steps with recorded log-prob NaN.
        """
        if len(prompts) != len(seeds):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt")
        if not prompts:
            return []
        return self.sample_from_cond(self.encode_prompts(prompts), seeds, module=module, group_seeds=group_seeds)

    @torch.no_grad()
    def sample_from_cond(
        self,
        cond: dict[str, torch.Tensor],
        seeds: list[int],
        *,
        module: torch.nn.Module | None = None,
        group_seeds: list[int] | None = None,
    ) -> list[tuple[DiffusionPart, np.ndarray]]:
        """``sample`` from conditioning tensors [B, ...] keyed as ``_cond_keys()`` instead of prompt strings
        (a unified model conditions on the token ids it generated itself)."""
        module = self.bundle.transformer if module is None else module
        device = module_device(module)
        cond = {k: v.to(device) for k, v in cond.items()}
        b, steps = len(seeds), self.num_inference_steps
        sigmas = self._sigmas.to(device).expand(b, -1)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        sde = self.sde_steps(seeds).to(device)
        x = self._initial_noise(gens, group_seeds).to(device)
        traj, logps = [x], []
        for i in range(steps):
            idx = torch.full((b,), i, dtype=torch.long, device=device)
            v = self._velocity(module, x, sigmas[:, i], cond)
            mean, std = self._sde_stats(x, v, sigmas, idx)
            x_sde = mean + bcast(std, mean) * self._noise(gens).to(device)
            x_ode = x + v * bcast(sigmas[:, i + 1] - sigmas[:, i], v)
            x = torch.where(bcast(sde[:, i], x_sde), x_sde, x_ode)
            logps.append(torch.where(sde[:, i], gaussian_log_prob(x, mean, std), torch.nan))
            traj.append(x)
        media = self.decode(x)
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
            out.append((part, media[i]))
        return out

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

    def velocity(
        self, module: torch.nn.Module, batch: dict[str, torch.Tensor], x: torch.Tensor, sigma: torch.Tensor
    ) -> torch.Tensor:
        """(Guided) velocity [B, ...] float32 of ``module`` at latents ``x`` [B, ...] and noise levels
        ``sigma`` [B], conditioned on the prompts of ``batch`` (from ``collate``); with grad.

        The forward-process losses (DiffusionNFT) use it on noised clean samples.
        """
        device = module_device(module)
        cond = {k: batch[k].to(device) for k in self._cond_keys()}
        return self._velocity(module, x.to(device=device, dtype=torch.float32), sigma.to(device), cond)

    def step_log_prob(
        self, module: torch.nn.Module, batch: dict[str, torch.Tensor], step_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recompute transition ``latents[b, j] -> latents[b, j + 1]`` (``j = step_index[b]``) with grad.

        ``batch`` comes from ``collate``; ``step_index`` is a LongTensor [B] (may differ per sample).
        Returns ``(log_prob [B], mean [B, *latent_shape], std [B])`` on the module's device.
        """
        device = module_device(module)
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
