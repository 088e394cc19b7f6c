"""``DiffusionTrainer``: RL for diffusion / flow image models (Flow-GRPO by default).

Placement (the seed's trainside recipes): the train ranks (Ray Train workers, FSDP2) hold bundle,
pipeline, backend, algorithm, stack and the trainside rollout; rewards are a Ray Serve app; prompts
come from a Ray Data dataset. The step itself (prompts -> rollout -> reward -> advantages -> train
-> log) is ``RLTrainer.run_step``; this class adds what is particular to images: the resolution
check against the model's latent factor on the driver, and sample images in MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass

from unirl_ray.config.recipe import RecipeError
from unirl_ray.core.sample import Sample
from unirl_ray.trainer.rl import RLRunConfig, RLTrainer


@dataclass(kw_only=True)
class DiffusionRunConfig(RLRunConfig):
    """The ``trainer:`` block of a diffusion recipe."""


class DiffusionTrainer(RLTrainer):
    domain = "diffusion"

    def validate_model(self) -> None:
        factor = self.bundle_cfg.latent_factor() if hasattr(self.bundle_cfg, "latent_factor") else 1
        for name in ("height", "width"):
            value = self.recipe.pipeline.get(name)
            if value is not None and (int(value) <= 0 or int(value) % factor):
                raise RecipeError(
                    f"pipeline.{name}={value} must be a positive multiple of {factor} "
                    "(VAE scale factor x transformer patch size of this model)"
                )

    def run_step(self, step: int) -> dict:
        metrics = super().run_step(step)
        metrics["perf/images_per_s"] = metrics["perf/samples_per_s"]
        return metrics

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        shown = [s for s in samples if s.image is not None][:16]
        captions = [f"{s.prompt} | r={s.reward if s.reward is None else round(s.reward, 4)}" for s in shown]
        self.tracker.log_images(step, [s.image for s in shown], captions, key="samples")
