"""``DiffusionTrainer``: RL for diffusion / flow image models (Flow-GRPO by default).

Placement: the train ranks (Ray Train workers, FSDP2) hold bundle, pipeline, backend, algorithm,
stack and, in the trainside layout, the rollout; in the separate layout (``rollout: DedicatedRollout``,
engine ``hf``) a Ray Serve app builds the same bundle + pipeline (+ the trained LoRA structure),
samples and records log-probs, and receives versioned, verified weights (LoRA adapters only when
training LoRA) after every ``sync.every`` steps. Rewards are Ray Serve apps (a source with ``app:``
gets its own, e.g. ``unirl_ray.rewards.image_model.CLIPScoreReward``); prompts come from Ray Data.
The step (prompts -> rollout -> reward -> advantages -> train -> sync -> log -> eval) is
``RLTrainer.run_step``; this class adds what is particular to images: the resolution check against
the model's latent factor on the driver, and sample / eval image grids in MLflow.

DiffusionNFT (``backend.ema_lora_cfg``) samples with the EMA shadow adapter in the trainside layout;
a dedicated engine serves the *trained* adapter instead (warned at validation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from unirl_ray.config.recipe import RecipeError
from unirl_ray.core.sample import Sample
from unirl_ray.tracking.media import DEFAULT_FPS, log_videos
from unirl_ray.trainer.rl import RLRunConfig, RLTrainer

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DiffusionRunConfig(RLRunConfig):
    """The ``trainer:`` block of a diffusion recipe."""


def check_image_size(bundle_cfg: Any, pipeline: Any, where: str = "pipeline") -> None:
    """``RecipeError`` when the pipeline's height / width (and a video's frames) do not fit the model's
    latent factor (VAE scale x patch size) and time factor; ``bundle_cfg`` is the family config or None."""
    factor = bundle_cfg.latent_factor() if hasattr(bundle_cfg, "latent_factor") else 1
    for name in ("height", "width"):
        value = pipeline.get(name)
        if value is not None and (int(value) <= 0 or int(value) % factor):
            raise RecipeError(
                f"{where}.{name}={value} must be a positive multiple of {factor} "
                "(VAE scale factor x transformer patch size of this model)"
            )
    if hasattr(bundle_cfg, "validate_video"):  # video families: frames must fit the VAE's time factor
        try:
            bundle_cfg.validate_video(int(pipeline.num_frames), int(pipeline.height), int(pipeline.width))
        except ValueError as exc:
            raise RecipeError(f"{where}: {exc}") from None


class DiffusionTrainer(RLTrainer):
    """RL for diffusion / flow image models: ``RLTrainer``'s step, plus image checks, metrics and grids."""

    domain = "diffusion"

    def validate_model(self) -> None:
        check_image_size(self.bundle_cfg, self.recipe.pipeline)
        if self.dedicated is not None and "ema_lora_cfg" in self.backend_cfgs:
            log.warning("rollout: DedicatedRollout with backend.ema_lora_cfg: the engine samples with the trained "
                        "adapter, not the EMA shadow adapter (DiffusionNFT's old policy in the trainside layout)")

    def run_step(self, step: int) -> dict:
        metrics = super().run_step(step)
        metrics["perf/images_per_s"] = metrics["perf/samples_per_s"]
        return metrics

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        shown = [s for s in samples if s.image is not None][:16]
        captions = [f"{s.prompt} | r={s.reward if s.reward is None else round(s.reward, 4)}" for s in shown]
        if shown and shown[0].image.ndim == 4:  # video frames [F, H, W, 3]: animated GIFs + frame strips
            fps = float(self.recipe.pipeline.get("fps") or DEFAULT_FPS)
            log_videos(self.tracker, step, [s.image for s in shown[:4]], captions, key="samples", fps=fps)
            return
        self.tracker.log_images(step, [s.image for s in shown], captions, key="samples")

    def log_eval(self, step: int, samples: list[Sample]) -> None:
        """An image grid (video: GIFs) of the eval samples under ``eval`` in MLflow."""
        shown = [s for s in samples if s.image is not None][:16]
        captions = [f"{s.prompt} | r={s.reward if s.reward is None else round(s.reward, 4)}" for s in shown]
        if shown and shown[0].image.ndim == 4:
            fps = float(self.recipe.pipeline.get("fps") or DEFAULT_FPS)
            log_videos(self.tracker, step, [s.image for s in shown[:4]], captions, key="eval", fps=fps)
            return
        self.tracker.log_images(step, [s.image for s in shown], captions, key="eval")
