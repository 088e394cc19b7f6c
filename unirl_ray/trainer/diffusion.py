"""``DiffusionTrainer``: RL for diffusion / flow image models (Flow-GRPO by default), trainside layout.

Placement (colocated, as the seed's trainside recipes): the train ranks (Ray Train workers, FSDP2)
hold bundle, pipeline, backend, algorithm, stack and the trainside rollout; rewards are a Ray Serve
app; prompts come from a Ray Data dataset. Each step, in order:

    prompts  -> data.next_batch(prompts_per_step), each prompt repeated group_size times
    rollout  -> the train ranks sample with the module they train (log-probs recorded per SDE step)
    reward   -> the reward Serve app scores the decoded images
    advantage-> the algorithm's group-relative advantages (on the driver: groups span ranks)
    train    -> every rank trains on the samples it generated (prepare_segment, mini-batches, step)
    log      -> MLflow metrics (+ images every ``tracking.log_samples_every`` steps)
    save     -> Ray Train checkpoint every ``trainer.checkpoint_every`` steps (shards + controller state)

``run_step`` below is that order; logging, checkpoints and progress are ``BaseTrainer.run_steps``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from unirl_ray.config.recipe import RecipeError, instantiate
from unirl_ray.core.sample import Sample
from unirl_ray.trainer.base import BaseTrainer, RunConfig, derive_seed

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DiffusionRunConfig(RunConfig):
    """The ``trainer:`` block of a diffusion recipe."""

    prompts_per_step: int = 4
    """Distinct prompts per step; each is sampled ``algorithm.group_size`` times."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {self.prompts_per_step}")


class DiffusionTrainer(BaseTrainer):
    domain = "diffusion"
    worker_sections = ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")
    driver_sections = ("trainer", "data", "reward", "tracking", "ray")

    # ------------------------------------------------------------ validation
    def validate_domain(self) -> None:
        recipe = self.recipe
        self.prompts_per_step = self.run_cfg.prompts_per_step
        self.prompt_log: list[tuple[int, list[str]]] = []  # (step, prompts) trained in this process
        self.data = self._build("data")
        self.reward_cfg = self._build("reward")
        self.algorithm = self._build("algorithm")  # driver copy: advantages only (no pipeline)
        self.group_size = int(getattr(self.algorithm, "group_size", 1))
        stack = self._build("stack")
        self.bundle_cfg = instantiate(recipe.bundle.config) if "config" in recipe.bundle else None
        for name in ("fsdp_cfg", "optimizer_cfg", "lr_scheduler_cfg", "lora_cfg"):
            if recipe.backend.get(name) is not None:
                instantiate(recipe.backend[name])
        total = self.prompts_per_step * self.group_size
        workers = self.ray_cfg.num_workers
        if total % workers:
            raise RecipeError(
                f"trainer.prompts_per_step x algorithm.group_size = {total} samples per step must divide evenly "
                f"over ray.scaling.num_workers={workers} (every FSDP rank must do the same work)"
            )
        try:
            stack.check_shard_size(total // workers)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
        self._validate_resolution()

    def _validate_resolution(self) -> None:
        factor = self.bundle_cfg.latent_factor() if hasattr(self.bundle_cfg, "latent_factor") else 1
        height, width = self.recipe.pipeline.get("height"), self.recipe.pipeline.get("width")
        for name, value in (("height", height), ("width", width)):
            if value is not None and (int(value) <= 0 or int(value) % factor):
                raise RecipeError(
                    f"pipeline.{name}={value} must be a positive multiple of {factor} "
                    "(VAE scale factor x transformer patch size of this model)"
                )

    def is_demo(self) -> bool:
        return bool(getattr(self.bundle_cfg, "is_demo", False))

    def extra_resources(self) -> dict[str, float]:
        opts = self.reward_cfg.ray_actor_options or {}
        need = {"CPU": float(opts.get("num_cpus", 1)) * self.reward_cfg.num_replicas}
        if opts.get("num_gpus"):
            need["GPU"] = float(opts["num_gpus"]) * self.reward_cfg.num_replicas
        return need

    # -------------------------------------------------------------- services
    def start_services(self) -> None:
        from unirl_ray.rewards import RewardClient

        self.reward = RewardClient.deploy(self.reward_cfg, app_name=f"{self.run_cfg.run_name}-reward")

    def stop_services(self) -> None:
        if getattr(self, "reward", None) is not None:
            self.reward.shutdown()

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("data"):
            self.data.load_state_dict(state["data"])

    def controller_state(self) -> dict[str, Any]:
        return {**super().controller_state(), "data": self.data.state_dict()}

    # ------------------------------------------------------------- one step
    def run_step(self, step: int) -> dict[str, Any]:
        t_step = time.perf_counter()
        rows = self.data.next_batch(self.prompts_per_step)
        self.prompt_log.append((step, [row["prompt"] for row in rows]))
        requests = self.make_requests(step, rows)

        t0 = time.perf_counter()
        samples = self.rollout(requests)
        metrics = {"timing/rollout": time.perf_counter() - t0}

        metrics |= self.reward.score(samples)
        metrics |= self.algorithm.compute_advantages(samples)

        t0 = time.perf_counter()
        metrics |= self.train(samples, seed=derive_seed(self.run_cfg.seed, "train", step))
        metrics["timing/train"] = time.perf_counter() - t0

        metrics["timing/step"] = time.perf_counter() - t_step
        metrics["perf/samples_per_s"] = metrics["perf/images_per_s"] = len(samples) / metrics["timing/step"]
        if self.tracker.should_log_samples(step):
            self.log_samples(step, samples)
        return metrics

    def make_requests(self, step: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each prompt ``group_size`` times, with a per-sample seed fixed by (seed, step, index)."""
        requests = []
        for p, row in enumerate(rows):
            columns = {k: v for k, v in row.items() if k not in ("prompt",)}
            for g in range(self.group_size):
                index = p * self.group_size + g
                requests.append({
                    "sample_id": f"s{step}-{index}",
                    "group_id": f"s{step}-p{p}",
                    "prompt": row["prompt"],
                    "columns": columns,
                    "seed": derive_seed(self.run_cfg.seed, "sample", step, index),
                })
        return requests

    def rollout(self, requests: list[dict[str, Any]]) -> list[Sample]:
        shards = _split(requests, self.group.world_size)
        results = self.group.call("generate", [{"requests": shard} for shard in shards])
        return [sample for shard in results for sample in shard]

    def train(self, samples: list[Sample], *, seed: int) -> dict[str, float]:
        """Send every rank the samples it generated (without images); returns reduced metrics."""
        shards = _split([_without_image(s) for s in samples], self.group.world_size)
        results = self.group.call("train", [{"samples": shard, "seed": seed} for shard in shards])
        return dict(results[0]["metrics"], **{"train/policy_version": results[0]["policy_version"]})

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        shown = [s for s in samples if s.image is not None][:16]
        captions = [f"{s.prompt} | r={s.reward if s.reward is None else round(s.reward, 4)}" for s in shown]
        self.tracker.log_images(step, [s.image for s in shown], captions, key="samples")


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    size = len(items) // parts
    return [items[i * size : (i + 1) * size] for i in range(parts)]


def _without_image(sample: Sample) -> Sample:
    import dataclasses

    return dataclasses.replace(sample, image=None)
