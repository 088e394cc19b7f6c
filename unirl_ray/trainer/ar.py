"""``ARTrainer``: RL for autoregressive language models (the GRPO family).

Two rollout modes, as in the seed: **direct** (the train ranks generate with the module they
train: no engine, no sync) and **dedicated** (a Ray Serve engine app receives versioned, verified
weights after each train step). The step (prompts -> rollout -> reward -> advantages -> train ->
sync -> log) is ``RLTrainer.run_step``; this class adds text metrics (response lengths, tokens/s)
and sample tables in MLflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from unirl_ray.core.sample import Sample
from unirl_ray.trainer.rl import RLRunConfig, RLTrainer


def pipeline_setting(pipeline: Any, name: str, where: str = "pipeline") -> Any:
    """A pipeline section's ``name``: the recipe's value, else the default of its ``_target_``'s constructor (None
    where it has neither)."""
    import inspect

    from unirl_ray.config.recipe import locate

    if name in pipeline:
        return pipeline.get(name)
    target = pipeline.get("_target_")
    try:
        param = inspect.signature(locate(target, where)).parameters.get(name) if target else None
    except (TypeError, ValueError):
        return None
    return None if param is None or param.default is param.empty else param.default


def check_context_length(bundle_cfg: Any, pipeline: Any, where: str = "pipeline") -> None:
    """``RecipeError`` when a text pipeline's longest sequence (``max_prompt_tokens + max_new_tokens``, its class's
    defaults where the recipe leaves them out) exceeds the model's context (``bundle_cfg.context_length``: the
    demo model's, or the folder's config.json); the ranks and every engine replica would refuse it only once
    started. ``bundle_cfg`` is the family config or None (nothing to check)."""
    from unirl_ray.config.recipe import RecipeError

    limit = getattr(bundle_cfg, "context_length", None)
    if not isinstance(limit, int):
        return
    lengths = [pipeline_setting(pipeline, name, where) for name in ("max_prompt_tokens", "max_new_tokens")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in lengths):
        return
    if sum(lengths) > limit:
        side = where[: -len("pipeline")] if where.endswith("pipeline") else ""  # "ar." on the prompt enhancer's side
        source = (f"max_position_embeddings in {bundle_cfg.pretrained_model_path}/config.json" if not bundle_cfg.is_demo
                  else f"the demo model's {side}bundle.config.tiny.max_position_embeddings")
        raise RecipeError(f"{where}.max_prompt_tokens + {where}.max_new_tokens = {lengths[0]} + {lengths[1]} = "
                          f"{sum(lengths)} exceeds the model's context of {limit} tokens ({source}); lower one of them")


@dataclass(kw_only=True)
class ARRunConfig(RLRunConfig):
    """The ``trainer:`` block of an AR recipe."""


def _completion(sample: Sample) -> str:
    return "".join(getattr(p, "text", "") for p in sample.parts if p.kind == "text")


def _num_tokens(sample: Sample) -> int:
    """Generated tokens of a sample, whether its parts are full (engine) or light (trainside)."""
    total = 0
    for part in sample.parts:
        if part.kind == "text":
            ids = getattr(part, "completion_ids", None)
            total += int(ids.numel()) if ids is not None else int(getattr(part, "num_tokens", 0))
    return total


class ARTrainer(RLTrainer):
    """RL for causal LMs: ``RLTrainer``'s step, plus response-length and token-rate metrics and sample tables."""

    domain = "ar"

    def validate_model(self) -> None:
        """The pipeline's longest sequence (``max_prompt_tokens + max_new_tokens``) fits the model's context (else
        the ranks and every engine replica would refuse it only once started). A pipeline that reads its
        prompts' images from a dataset column (``VLMPipeline``) needs that column carried by ``data.columns`` and
        a rollout that passes columns on (trainside, or the HF engine)."""
        from unirl_ray.config.recipe import RecipeError, locate

        target = self.recipe.pipeline.get("_target_")
        pipeline_cls = locate(target, "pipeline") if target else None
        check_context_length(self.bundle_cfg, self.recipe.pipeline)
        if not getattr(pipeline_cls, "samples_from_columns", False):
            return
        column = self.recipe.pipeline.get("image_column", "image")
        carried = self.recipe.data.get("columns")
        if carried is not None and column not in carried:
            raise RecipeError(f"pipeline.image_column={column!r} is not among data.columns={list(carried)}: add it "
                              "(the images reach the pipeline as a column of their prompt)")
        if self.dedicated is not None and self.dedicated.engine != "hf":
            raise RecipeError(f"rollout.engine={self.dedicated.engine} does not take prompts with images yet (its "
                              "multimodal inputs are not wired): use rollout.engine=hf, or rollout: TrainsideRollout")

    def rollout_metrics(self, samples: list[Sample]) -> dict[str, float]:
        lengths = np.array([_num_tokens(s) for s in samples], dtype=np.float64)
        metrics = super().rollout_metrics(samples)
        if lengths.size:
            metrics |= {
                "rollout/response_len_mean": float(lengths.mean()),
                "rollout/response_len_max": float(lengths.max()),
                "rollout/response_len_min": float(lengths.min()),
                "rollout/tokens": float(lengths.sum()),
            }
        return metrics

    def run_step(self, step: int) -> dict[str, Any]:
        metrics = super().run_step(step)
        if "rollout/tokens" in metrics:
            metrics["perf/rollout_tokens_per_s"] = metrics["rollout/tokens"] / max(metrics["timing/rollout"], 1e-9)
        return metrics

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        shown = samples[:32]
        self.tracker.log_table(
            {
                "step": [step] * len(shown),
                "prompt": [s.prompt for s in shown],
                "completion": [_completion(s) for s in shown],
                "reward": [s.reward for s in shown],
                "advantage": [s.advantage for s in shown],
                "policy_version": [s.policy_version for s in shown],
            },
            f"samples/step_{step:06d}.json",
        )
