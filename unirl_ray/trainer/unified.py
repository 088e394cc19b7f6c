"""``UnifiedModelTrainer``: one backbone that writes and draws (HunyuanImage-3.0's topology), trained on its
text segment and its image in one optimizer step.

The train ranks hold one side (a flat recipe): the unified bundle and pipeline, one ``FSDPBackend`` and a
``UnifiedModelTrainStack`` over the stage algorithms of ``algorithm: {text: ..., image: ...}`` (the GRPO
family for the think / recaption segment; Flow-GRPO for a diffusion image, ``unirl_ray.models.unified``,
or the GRPO family for Janus-Pro's discrete image tokens, ``unirl_ray.models.janus``; either stage may be
left out to train the other alone). Each step, in order (``RLTrainer.run_step``):

    prompts   -> data.next_batch(prompts_per_step)
    rollout   -> on the train ranks (``TrainsideRollout``: exactly on-policy, no weight sync): for each prompt
                 N = algorithm.text.group_size text segments, for each M = trainer.images_per_text images
                 conditioned on prompt + the generated tokens; each Sample is one image with the Parts
                 [TextPart (stage ``text``, part_id = its segment), DiffusionPart (stage ``image``)]
    reward    -> the reward app(s) score the image against the ORIGINAL prompt; the generated text is the
                 ``completions`` column (for format / length rewards)
    credit    -> ``LineageCredit``: a text segment's reward is the mean (``trainer.text_reward: max``) of its
                 images', its advantage relative to the N segments of its prompt; an image's advantage is its
                 segment's (``trainer.image_group_scope: shared``, UniGRPO; the default, and what one image per
                 segment needs), or relative to the M images of its segment (``text``) or to all N x M of its
                 prompt (``prompt``)
    train     -> every rank: one ``UnifiedModelTrainStack`` step over both stages (each distinct text segment
                 trained once, every image once; ``stack.loss_weights``); the ranks report the advantage each
                 Part carried into its stage and the driver checks them against the ones it assigned
    log       -> MLflow metrics per stage (``text/train/loss``, ``image/algo/clip_frac``, ``image/rollout/logp_gap``),
                 and every ``tracking.log_samples_every`` steps a table (prompt, generated text, rewards and
                 advantages per stage) and an image grid captioned with the generated text

Rollout layouts: ``rollout: TrainsideRollout`` (the train ranks sample with the module they train: one
engine, no sync), or the seed's **engine pair** ``rollout: {text: DedicatedRollout, image: DedicatedRollout}``:
``<run>-rollout-text`` writes the segments and ``<run>-rollout-image`` draws from prompt + segment ids, both HF
engines of the same bundle and pipeline (each serving one stage, ``pipeline.sample_stage``), fed after every
``sync.every`` steps by ONE export of the backbone (``EngineSet``: versioned, verified on every replica;
``weight_sync/engines`` counts the engines it reached). ``placement: colocated`` gives each engine its own turn
on the train workers' devices. A single ``DedicatedRollout`` is refused (name the pair).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from unirl_ray.algorithms.credit import CreditAssignment, LineageCredit
from unirl_ray.config.checks import check_literal_fields
from unirl_ray.config.recipe import RecipeError, instantiate, locate
from unirl_ray.core.sample import Part, Sample, TextPart, part_advantage, routed_part
from unirl_ray.rollout.dedicated import DedicatedEngine, DedicatedRollout, EngineSet
from unirl_ray.rollout.trainside import TrainsideRollout
from unirl_ray.rollout.weight_sync import TensorWeightSync
from unirl_ray.trainer.base import BaseTrainer, derive_seed
from unirl_ray.trainer.diffusion import check_image_size
from unirl_ray.trainer.rl import RLRunConfig, RLTrainer, _split, engine_sections

log = logging.getLogger(__name__)

TEXT_STAGE, IMAGE_STAGE = "text", "image"  # = unirl_ray.models.unified.pipeline's (kept import-free here)
_SCOPES = {"shared": "shared", "text": "rewrite", "prompt": "prompt"}


@dataclass(kw_only=True)
class UnifiedRunConfig(RLRunConfig):
    """The ``trainer:`` block of a unified-model recipe."""

    images_per_text: int = 1
    """M: images drawn from each text segment (N = algorithm.text.group_size segments per prompt)."""
    image_group_scope: Literal["shared", "text", "prompt"] = "shared"
    """An image's advantage: its text segment's (``shared``), relative to the M images of its segment (``text``,
    needs M >= 2) or to all N x M images of its prompt (``prompt``)."""
    text_reward: Literal["mean", "max"] = "mean"
    """A text segment's reward from its images' rewards."""
    normalize_std: bool = True
    """Divide the group-relative advantages (both stages) by their group's standard deviation."""
    texts_per_image_only: int = 1
    """N when only the image stage trains (``algorithm`` without ``text``); otherwise N is algorithm.text.group_size."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_literal_fields(self, "trainer")
        if self.images_per_text < 1 or self.texts_per_image_only < 1:
            raise ValueError(f"trainer.images_per_text and trainer.texts_per_image_only must be >= 1, got "
                             f"{self.images_per_text} and {self.texts_per_image_only}")
        if self.image_group_scope == "text" and self.images_per_text < 2:
            raise ValueError("trainer.image_group_scope=text compares the images of one text segment: it needs "
                             "trainer.images_per_text >= 2 (or use image_group_scope: shared)")


class UnifiedModelTrainer(RLTrainer):
    """The unified model: ``RLTrainer``'s step over a two-stage sample (see the module docstring)."""

    domain = "unified_model"

    # ------------------------------------------------------------ validation
    def driver_algorithm(self) -> dict[str, Any]:
        section = self.recipe.get("algorithm")
        keys = sorted(section.keys()) if hasattr(section, "keys") else []
        if not keys or "_target_" in keys or not set(keys) <= {TEXT_STAGE, IMAGE_STAGE}:
            raise RecipeError("algorithm: a unified recipe maps its stages to algorithms, e.g. algorithm: {text: "
                              "{_target_: unirl_ray.algorithms.GRPO, group_size: 4}, image: {_target_: "
                              "unirl_ray.algorithms.FlowGRPO, group_size: 2}} (either stage may be left out); got "
                              f"{', '.join(keys) or 'nothing'}")
        algorithms = {name: instantiate(section[name]) for name in (TEXT_STAGE, IMAGE_STAGE) if name in section}
        pipeline_cls = locate(self.recipe.pipeline.get("_target_"), "pipeline")
        kinds = getattr(pipeline_cls, "stage_parts", None)
        if not isinstance(kinds, dict) or set(kinds) != {TEXT_STAGE, IMAGE_STAGE}:
            raise RecipeError(f"pipeline: {self.recipe.pipeline.get('_target_')} is not a unified pipeline (one that writes "
                              "a text segment and then the image: unirl_ray.models.unified.UnifiedPipeline or "
                              "unirl_ray.models.janus.JanusPipeline)")
        cfg = self.run_cfg
        for name, alg in algorithms.items():
            alg.stage = name  # it takes the Parts of its stage (Janus' two stages are both TextParts)
            if getattr(alg, "part_type", None) is not kinds[name]:
                raise RecipeError(f"algorithm.{name}: {type(alg).__name__} does not train {kinds[name].__name__}s, which "
                                  f"the {name} stage of {pipeline_cls.__name__} generates")
            # LineageCredit computes both stages' advantages: the algorithms' own advantage options must agree
            for key, wanted in (("normalize_std", cfg.normalize_std), ("advantage_estimator", "grpo"),
                                ("global_std", False if cfg.normalize_std else getattr(alg, "global_std", False))):
                have = getattr(alg, key, wanted)
                if have != wanted:
                    raise RecipeError(f"algorithm.{name}.{key}={have!r}: the unified trainer's credit assignment "
                                      f"(LineageCredit) computes the advantages of both stages, group-relative with "
                                      f"the group's own std (trainer.normalize_std={cfg.normalize_std}); set "
                                      f"algorithm.{name}.{key}={wanted!r}")
        return algorithms

    def samples_per_prompt(self) -> int:
        """N text segments x M images (one Sample per image)."""
        return self.texts_per_prompt() * self.run_cfg.images_per_text

    def texts_per_prompt(self) -> int:
        text = self.algorithm.get(TEXT_STAGE)
        if text is None:  # only the image trains: the segments are still written (and condition the images)
            return self.run_cfg.texts_per_image_only
        size = int(getattr(text, "group_size", 0) or 0)
        if size < 2:
            raise RecipeError("algorithm.text.group_size must be >= 2 (text segments per prompt, group-relative advantages)")
        return size

    def validate_model(self) -> None:
        from unirl_ray.train.stack import UnifiedModelTrainStack

        recipe, cfg, workers = self.recipe, self.run_cfg, self.ray_cfg.num_workers
        self.engine_cfgs = self._engine_pair()
        stack_cls = instantiate(recipe.stack)
        if not isinstance(stack_cls, UnifiedModelTrainStack):
            raise RecipeError("stack: a unified recipe trains its stages in one optimizer step: _target_: "
                              "unirl_ray.train.stack.UnifiedModelTrainStack")
        weights = dict(recipe.stack.get("loss_weights") or {})
        unknown = sorted(set(weights) - set(self.algorithm))
        if unknown:
            raise RecipeError(f"stack.loss_weights names stage(s) {', '.join(unknown)} that algorithm does not train "
                              f"({', '.join(self.algorithm)})")
        if stack_cls.cfg.num_updates_per_batch > 1:
            single = [n for n, a in self.algorithm.items() if not a.supports_multi_update]
            if single:
                raise RecipeError(f"stack.num_updates_per_batch={stack_cls.cfg.num_updates_per_batch} but algorithm."
                                  f"{single[0]} does not support several updates per rollout; set it to 1")
        n, m = self.texts_per_prompt(), cfg.images_per_text
        group = {"shared": n, "text": m, "prompt": n * m}[cfg.image_group_scope]
        if IMAGE_STAGE in self.algorithm and group < 2:  # a group of one has advantage 0: nothing would be learned
            raise RecipeError(f"trainer.image_group_scope={cfg.image_group_scope} compares each image with {group - 1} "
                              f"other(s) ({n} text segment(s) x {m} image(s) per prompt): the image stage would train "
                              "on advantage 0. Without a text stage use image_group_scope: prompt with "
                              "images_per_text >= 2 (or texts_per_image_only >= 2)")
        texts = self.prompts_per_step * self.texts_per_prompt()
        if texts % workers:
            raise RecipeError(f"trainer.prompts_per_step x algorithm.text.group_size = {texts} text segments per step "
                              f"must divide evenly over ray.scaling.num_workers={workers}: a segment and its images "
                              "are made and trained on one rank")
        check_image_size(self.bundle_cfg, recipe.pipeline)

    def _engine_pair(self) -> dict[str, DedicatedRollout]:
        """``{}`` for a trainside rollout, else the engine pair of ``rollout: {text: ..., image: ...}``."""
        section = self.recipe.rollout
        target = section.get("_target_")
        if target is not None:
            cls = locate(target, "rollout")
            if isinstance(cls, type) and issubclass(cls, DedicatedRollout):
                raise RecipeError("rollout: a unified model rolls out on the train ranks (_target_: "
                                  "unirl_ray.rollout.TrainsideRollout) or on an engine pair, one app per stage fed by "
                                  "the one backbone: rollout: {text: {_target_: unirl_ray.rollout.DedicatedRollout, "
                                  "engine: hf}, image: {_target_: unirl_ray.rollout.DedicatedRollout, engine: hf}}")
            if not (isinstance(cls, type) and issubclass(cls, TrainsideRollout)):
                raise RecipeError("rollout: _target_ must be unirl_ray.rollout.TrainsideRollout, or give the engine "
                                  "pair {text: DedicatedRollout, image: DedicatedRollout}")
            return {}
        if sorted(section.keys()) != sorted((TEXT_STAGE, IMAGE_STAGE)):
            raise RecipeError(f"rollout: an engine pair names the stages text and image, got {', '.join(section.keys())}")
        pair = {}
        for stage in (TEXT_STAGE, IMAGE_STAGE):
            cfg = instantiate(section[stage])
            if not isinstance(cfg, DedicatedRollout) or cfg.engine != "hf":
                raise RecipeError(f"rollout.{stage}: each engine of the pair is _target_: unirl_ray.rollout.DedicatedRollout "
                                  "with engine: hf (the family's own pipeline, so its log-probs are the trainer's)")
            pair[stage] = cfg
        if self.sync is None:
            self.sync = TensorWeightSync()
        return pair

    def engine_configs(self) -> dict[str, Any]:
        return {**super().engine_configs(), **self.engine_cfgs}  # the engine pair, one app per stage

    # ------------------------------------------------------- the engine pair
    def rank_sections(self, *, rollout: bool = True) -> dict[str, Any]:
        return BaseTrainer.rank_sections(self, rollout=rollout and not self.engine_cfgs)  # the pair rolls out

    def start_services(self) -> None:
        """The reward app(s), and with an engine pair ``<run>-rollout-text`` and ``<run>-rollout-image``: the same
        bundle and pipeline, each serving one stage, both fed by the backbone's weights."""
        super().start_services()
        base = engine_sections(self.recipe, self.backend_cfgs)
        self.engine_set = EngineSet(
            self.engine_cfgs, app_names={s: f"{self.run_cfg.run_name}-rollout-{s}" for s in self.engine_cfgs},
            sections={s: {**base, "stage": s} for s in self.engine_cfgs}, feeds=dict.fromkeys(self.engine_cfgs),
            seed=self.run_cfg.seed)
        self.engine_set.deploy()

    def start_workers(self) -> dict[str, Any]:
        announced = super().start_workers()
        if self.engine_set.ready():  # both engines start from the (restored) weights, one export
            self.engine_set.push(self.sync, self.group, self.policy_version)
        return announced

    def await_engines(self) -> None:
        super().await_engines()
        if getattr(self, "engine_set", None) is not None:
            self.engine_set.ready()

    def engine_services(self) -> list[DedicatedEngine]:
        return [*super().engine_services(), *self._pair().values()]

    def _pair(self) -> dict[str, DedicatedEngine]:
        pair = getattr(self, "engine_set", None)
        return pair.engines if pair is not None else {}

    def after_restart(self, announced: dict[str, Any], restored_step: int) -> None:
        super().after_restart(announced, restored_step)
        if self._pair():  # the restarted ranks hold the checkpoint's weights: both engines get them
            self.engine_set.push(self.sync, self.group, self.policy_version)

    def sync_engines(self, step: int) -> dict[str, float]:
        """After training ``step``: one export of the backbone, published to both engines (versioned, verified)."""
        if not self._pair() or not self.sync.due(step):
            return {}
        self.quiesce_rollouts()
        metrics = self.engine_set.push(self.sync, self.group, self.policy_version)[None]
        metrics["timing/weight_sync"] = metrics["weight_sync/seconds"]
        return metrics

    def _on_engine(self, stage: str, requests: list[dict[str, Any]]) -> list[Sample]:
        engine = self.engine_set.engines[stage]
        out = self.on_engine(engine, requests)  # a colocated engine: the train workers hand over the devices
        if engine.colocated:
            self._pair_metrics |= {f"{stage}/{k}": v for k, v in self._stage_metrics.items()}
            self._stage_metrics = {}
        return out

    def _rollout_on_pair(self, requests: list[dict[str, Any]]) -> list[Sample]:
        """The text engine writes each distinct segment; the image engine draws each image from prompt + segment ids."""
        from unirl_ray.models.unified.pipeline import text_of

        self._pair_metrics: dict[str, float] = {}
        texts: dict[str, dict[str, Any]] = {}
        for r in requests:
            texts.setdefault(r["text_id"], {"sample_id": r["text_id"], "group_id": r["group_id"], "prompt": r["prompt"],
                                            "columns": r["columns"], "seed": r["text_seed"]})
        t0 = time.perf_counter()
        text_samples = self._on_engine(TEXT_STAGE, list(texts.values()))
        written = {s.sample_id: routed_part(s, TextPart, TEXT_STAGE) for s in text_samples}
        versions = {s.sample_id: s.policy_version for s in text_samples}
        t1 = time.perf_counter()
        draws = [{k: v for k, v in r.items() if k not in ("text_id", "text_seed")} | {"context_ids": text_of(written[r["text_id"]])}
                 for r in requests]
        drawn = self._on_engine(IMAGE_STAGE, draws)
        self._pair_metrics |= {"timing/rollout_text": t1 - t0, "timing/rollout_image": time.perf_counter() - t1}
        return [Sample(sample_id=d.sample_id, group_id=d.group_id, prompt=d.prompt, columns=dict(d.columns),
                       parts=[dataclasses.replace(written[r["text_id"]]), routed_part(d, Part, IMAGE_STAGE)],
                       image=d.image, policy_version=min(d.policy_version, versions[r["text_id"]]))
                for r, d in zip(requests, drawn)]

    def make_credit(self) -> CreditAssignment:
        cfg = self.run_cfg
        return LineageCredit(text_stage=TEXT_STAGE, image_stage=IMAGE_STAGE, rewrite_reward=cfg.text_reward,
                             image_group_scope=_SCOPES[cfg.image_group_scope], normalize_std=cfg.normalize_std)

    # ------------------------------------------------------------- one step
    def make_requests(self, step: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One request per image; the M images of a text segment share its ``text_id`` and ``text_seed``."""
        n, m, seed = self.texts_per_prompt(), self.run_cfg.images_per_text, self.run_cfg.seed
        requests = []
        for p, row in enumerate(rows):
            columns = {k: v for k, v in row.items() if k != "prompt"}
            for t in range(n):
                text_id = f"s{step}-p{p}-t{t}"
                for i in range(m):
                    index = (p * n + t) * m + i
                    requests.append({
                        "sample_id": f"{text_id}-i{i}", "group_id": f"s{step}-p{p}", "prompt": row["prompt"],
                        "columns": columns, "text_id": text_id,
                        "text_seed": derive_seed(seed, "text", step, p * n + t),
                        "seed": derive_seed(seed, "image", step, index),
                        "group_seed": derive_seed(seed, "group", step, p),
                    })
        return requests

    def rollout(self, requests: list[dict[str, Any]]) -> list[Sample]:
        samples = self._rollout_on_pair(requests) if self.engine_cfgs else super().rollout(requests)
        if [s.sample_id for s in samples] != [r["sample_id"] for r in requests]:
            raise RuntimeError("the train ranks returned unified samples out of order or incomplete")
        for s in samples:  # text rewards (format, length) read what the model wrote
            s.columns["completions"] = routed_part(s, TextPart, TEXT_STAGE).text
        return samples

    def rollout_metrics(self, samples: list[Sample]) -> dict[str, float]:
        texts = {routed_part(s, TextPart, TEXT_STAGE).part_id: routed_part(s, TextPart, TEXT_STAGE) for s in samples}
        tokens = [int(t.num_tokens) if t.completion_ids is None else int(t.completion_ids.numel()) for t in texts.values()]
        return {**super().rollout_metrics(samples), **getattr(self, "_pair_metrics", {}), "rollout/response_len_mean": float(np.mean(tokens)),
                "rollout/response_len_max": float(np.max(tokens)), "unified/text_segments": float(len(texts)),
                "unified/images": float(len(samples))}

    def train(self, samples: list[Sample], *, seed: int) -> dict[str, float]:
        """Send every rank its shard (without media), then check that each rank trained every stage on the
        advantages the driver assigned (each distinct Part once, in shard order)."""
        from unirl_ray.train.stack import distinct_parts

        shards = _split([dataclasses.replace(s, image=None) for s in samples], self.group.world_size)
        results = self.group.call("train", [{"samples": shard, "seed": seed} for shard in shards])
        checked = 0
        for r, (shard, result) in enumerate(zip(shards, results)):
            got = result.get("advantages") or {}
            for stage, algorithm in self.algorithm.items():
                sent = [part_advantage(s, algorithm.part_of(s)) for s in distinct_parts(shard, algorithm.part_of)]
                if got.get(stage) != sent:  # exactly: the same floats, in the same order
                    raise RuntimeError(f"rank {r} trained stage {stage!r} on other advantages than the driver assigned "
                                       f"(first: {(got.get(stage) or [])[:3]} vs {sent[:3]}): a Part's advantage was lost")
                checked += len(sent)
        self.policy_version = int(results[0]["policy_version"])
        return dict(results[0]["metrics"], **{"train/policy_version": float(self.policy_version),
                                              "unified/advantages_checked": float(checked)})

    # ------------------------------------------------------------- logging
    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """A table (prompt, generated text, rewards and advantages per stage) and an image grid with the text."""
        shown = samples[:32]
        parts = [(routed_part(s, TextPart, TEXT_STAGE), routed_part(s, Part, IMAGE_STAGE)) for s in shown]
        self.tracker.log_table(
            {
                "step": [step] * len(shown),
                "prompt": [s.prompt for s in shown],
                "generated_text": [t.text for t, _ in parts],
                "reward": [s.reward for s in shown],
                "text_reward": [t.reward for t, _ in parts],
                "text_advantage": [t.advantage for t, _ in parts],
                "image_advantage": [i.advantage for _, i in parts],
            },
            f"samples/step_{step:06d}.json",
        )
        drawn = [(s, t) for s, (t, _) in zip(shown, parts) if s.image is not None][:16]
        captions = [f"{s.prompt} | {t.text} | r={s.reward if s.reward is None else round(s.reward, 4)}" for s, t in drawn]
        if drawn:
            self.tracker.log_images(step, [s.image for s, _ in drawn], captions, key="images")  # its own captions table

    def log_eval(self, step: int, samples: list[Sample]) -> None:
        shown = [s for s in samples if s.image is not None][:16]
        captions = [f"{s.prompt} | {routed_part(s, TextPart, TEXT_STAGE).text} | r="
                    f"{s.reward if s.reward is None else round(s.reward, 4)}" for s in shown]
        if shown:
            self.tracker.log_images(step, [s.image for s in shown], captions, key="eval")
