"""``PETrainer``: the prompt enhancer. An LLM rewrites the user's prompt, a diffusion model draws the
rewrite, and either or both learn from the image rewards.

The train ranks hold two named sides (``train.rank``): ``ar`` (the rewriter: a causal LM with the GRPO
family) and ``diffusion`` (the image model: Flow-GRPO or DiffusionNFT), built from the recipe's ``ar:``
and ``diffusion:`` blocks, each a full side (bundle, pipeline, backend, algorithm, stack, rollout).
``trainer.freeze_llm`` makes the rewriter rollout-only, ``trainer.freeze_diffusion`` the image model
(the PromptEnhancer / RePrompt setup: a small rewriter in front of a large frozen image model).

Each step, in order (``run_step``):

    prompts   -> data.next_batch(prompts_per_step); each rank takes prompts_per_step / num_workers of them
    rewrite   -> the ``ar`` side writes N = ar.algorithm.group_size rewrites per prompt (``rollout.instruction``),
                 cleaned by ``rollout`` (``RewriteRollout``: reasoning dropped, the text after the marker kept,
                 an empty or off-format rewrite falls back to the original prompt: ``pe/fallback_frac``)
    draw      -> the ``diffusion`` side draws M = diffusion.algorithm.group_size images per rewrite, on the rank
                 that wrote it; each Sample is one image with the ordered Parts [rewrite, image]
    reward    -> the reward app(s). Reward fns get ``prompts`` = the **original** prompts (so the rewriter cannot
                 win by drifting from the user's intent; ``reward.image_prompt: rewrite`` passes the rewrites),
                 and the columns ``original_prompt``, ``rewrite`` (what was drawn) and ``completions`` (what
                 the rewriter wrote, which text rewards such as a format check score)
    credit    -> ``LineageCredit``: image advantages over the M images of a rewrite (``trainer.diffusion_group_scope:
                 prompt``: over all N x M images of a prompt); each rewrite's reward is the mean (or max,
                 ``trainer.rewrite_reward``) of its images', its advantage relative to the N rewrites of its prompt
    train     -> every rank trains each unfrozen side on the Parts routed to it (one Sample per rewrite for
                 ``ar``, one per image for ``diffusion``), ``ar`` first, then ``diffusion``; the ranks report the
                 advantage each Part carried into its side's stack and the driver checks them against the ones it
                 assigned (a score lost between driver and rank fails the step)
    log       -> MLflow metrics per side (``ar/algo/clip_frac``, ``diffusion/train/loss``, ...), and every
                 ``tracking.log_samples_every`` steps a table (prompt, rewrite, rewards, advantages per side)
                 and an image grid captioned with the rewrites

Layouts, per side (its ``rollout:``): ``TrainsideRollout`` samples on the train ranks with the module
they train (a rank then draws the images of its own rewrites and trains both there);
``DedicatedRollout`` puts the side on its own engine app (``<run>-rollout-<side>``: HF or vLLM for the
rewriter, HF for the image model) that receives the side's weights after every ``sync.every`` steps,
versioned and verified per side, ``placement: separate`` or ``colocated`` (the workers offload the trained
sides' state while the engine takes its turn; a frozen side's weights stay resident), as in the
single-side trainers. A frozen side rolls out on the ranks.

With ``diffusion_group_scope: prompt`` a reward that scores only the rewrite (a format or length reward)
differs between the rewrites of a prompt and so enters the image advantages too; under ``rewrite`` it is
the same for every image of a group and cancels out.

Checkpoints hold one folder per trained side, and ``trainer.export_dir`` receives one model folder per
trained side (``<export_dir>/ar``, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from omegaconf import OmegaConf

from unirl_ray.algorithms.credit import CreditAssignment, LineageCredit
from unirl_ray.config.checks import check_literal_fields
from unirl_ray.config.recipe import RecipeError, instantiate, locate
from unirl_ray.core.sample import DiffusionPart, Sample, TextPart, part_advantage, routed_part
from unirl_ray.rollout.dedicated import DedicatedEngine, DedicatedRollout, EngineSet
from unirl_ray.rollout.trainside import TrainsideRollout
from unirl_ray.rollout.weight_sync import TensorWeightSync
from unirl_ray.trainer.base import BaseTrainer, RunConfig, derive_seed
from unirl_ray.trainer.ar import check_context_length
from unirl_ray.trainer.diffusion import check_image_size
from unirl_ray.trainer.rl import RLTrainer, _in_background, _split, backend_configs, engine_sections

log = logging.getLogger(__name__)

TEXT_SIDE, IMAGE_SIDE = "ar", "diffusion"
SIDES = (TEXT_SIDE, IMAGE_SIDE)
TRAIN_SECTIONS = ("backend", "algorithm", "stack")
"""What a frozen side leaves behind on the ranks (it keeps bundle, pipeline and rollout)."""


@dataclass(kw_only=True)
class PERunConfig(RunConfig):
    """The ``trainer:`` block of a prompt-enhancer recipe (no held-out evaluation yet: rewards and sample
    grids are logged every step)."""

    prompts_per_step: int = 4
    """Distinct prompts per step; each gets N rewrites, each rewrite M images (the sides' group sizes)."""
    freeze_llm: bool = False
    """The rewriter (``ar`` side) only rolls out: no optimizer, nothing checkpointed."""
    freeze_diffusion: bool = False
    """The image model (``diffusion`` side) only rolls out: only the rewriter learns."""
    rewrite_reward: Literal["mean", "max"] = "mean"
    """A rewrite's reward from its images' rewards."""
    diffusion_group_scope: Literal["rewrite", "prompt"] = "rewrite"
    """The group an image's advantage is relative to: the M images of its rewrite, or all N x M of its prompt."""
    normalize_std: bool = True
    """Divide the group-relative advantages (both sides) by their group's standard deviation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_literal_fields(self, "trainer")
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.freeze_llm and self.freeze_diffusion:
            raise ValueError("trainer.freeze_llm and trainer.freeze_diffusion are both true: nothing would train; "
                             "unfreeze at least one side")

    @staticmethod
    def holds_previous_export(directory: str) -> bool:
        """An earlier PE export: one earlier export per side folder (``ar``, ``diffusion``) and nothing else."""
        from unirl_ray.train.export import is_previous_export

        folder = os.path.abspath(os.path.expanduser(directory))
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return bool(names) and all(n in SIDES and is_previous_export(os.path.join(folder, n)) for n in names)


def _num_tokens(part: TextPart) -> int:
    """Generated tokens of a rewrite, whether its Part is full (an engine's) or light (a rank's)."""
    return int(part.completion_ids.numel()) if part.completion_ids is not None else int(part.num_tokens)


class PETrainer(RLTrainer):
    """The prompt enhancer: ``RLTrainer``'s step with a composed rollout over two sides (module docstring)."""

    domain = "pe"
    worker_sections = SIDES
    driver_sections = ("trainer", "data", "reward", "rollout", "tracking", "ray", "sync")

    def optional_sections(self) -> set[str]:
        return {"sync"}

    # ------------------------------------------------------------ validation
    def validate_domain(self) -> None:
        recipe, cfg = self.recipe, self.run_cfg
        self.prompts_per_step = cfg.prompts_per_step
        self.prompt_log: list[tuple[int, list[str]]] = []
        self.data = self._build("data")
        self.reward_cfg = self._build("reward")
        self.image_prompt = self.reward_cfg.image_prompt
        try:
            self.reward_cfg.check_learnable()
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
        self.rewrite = self._build("rollout")
        if not hasattr(self.rewrite, "ask") or not hasattr(self.rewrite, "clean"):
            raise RecipeError("rollout: a prompt-enhancer recipe's rollout block says how rewrites are asked for and "
                              "cleaned: _target_: unirl_ray.rollout.prompt_rewrite.RewriteRollout")
        frozen = {TEXT_SIDE: cfg.freeze_llm, IMAGE_SIDE: cfg.freeze_diffusion}
        self.trained_sides = [name for name in SIDES if not frozen[name]]
        workers = self.ray_cfg.num_workers
        if self.prompts_per_step % workers:
            raise RecipeError(f"trainer.prompts_per_step={self.prompts_per_step} must divide evenly over "
                              f"ray.scaling.num_workers={workers}: each rank rewrites and draws whole prompts (the "
                              "rewrites and images of a prompt train on the rank that made them)")
        self.side_algorithms: dict[str, Any] = {}
        self.backend_cfgs: dict[str, dict[str, Any]] = {}
        self.engine_cfgs: dict[str, DedicatedRollout] = {}
        for name in SIDES:
            block = recipe[name]
            for section in ("bundle", "pipeline", "algorithm", "rollout", *(() if frozen[name] else TRAIN_SECTIONS)):
                if block.get(section) is None:
                    raise RecipeError(f"{name}.{section} is missing: the {name} side needs bundle, pipeline, backend, "
                                      "algorithm, stack and rollout (a frozen side's backend and stack may be null)")
            unknown = sorted(set(block) - {"bundle", "pipeline", *TRAIN_SECTIONS, "rollout"})
            if unknown:
                raise RecipeError(f"{name}: unknown section(s) {', '.join(unknown)}; a side has bundle, pipeline, "
                                  "backend, algorithm, stack, rollout")
            rollout_cls = locate(block.rollout.get("_target_"), f"{name}.rollout")
            if isinstance(rollout_cls, type) and issubclass(rollout_cls, DedicatedRollout):
                if frozen[name]:
                    raise RecipeError(f"{name}.rollout: a frozen side has no new weights to send an engine; it rolls "
                                      "out on the train ranks (_target_: unirl_ray.rollout.TrainsideRollout)")
                self.engine_cfgs[name] = instantiate(block.rollout)
            elif not (isinstance(rollout_cls, type) and issubclass(rollout_cls, TrainsideRollout)):
                raise RecipeError(f"{name}.rollout: _target_ must be unirl_ray.rollout.TrainsideRollout (on the train "
                                  "ranks) or unirl_ray.rollout.DedicatedRollout (an engine app)")
            algorithm = instantiate(block.algorithm)  # driver copy: its group size and the Part it trains
            want = TextPart if name == TEXT_SIDE else DiffusionPart
            if getattr(algorithm, "part_type", None) is not want:
                raise RecipeError(f"{name}.algorithm: {type(algorithm).__name__} does not train {want.__name__}s")
            # LineageCredit computes both sides' advantages: the algorithm's own advantage options must agree
            for key, wanted in (("normalize_std", cfg.normalize_std), ("advantage_estimator", "grpo"),
                                ("global_std", False if cfg.normalize_std else getattr(algorithm, "global_std", False))):
                have = getattr(algorithm, key, wanted)
                if have != wanted:
                    raise RecipeError(
                        f"{name}.algorithm.{key}={have!r}: the prompt enhancer's credit assignment (LineageCredit) computes "
                        f"the advantages of both sides, group-relative over rewrites / images with the group's own std "
                        f"(trainer.normalize_std={cfg.normalize_std}); set {name}.algorithm.{key}={wanted!r}")
            if int(getattr(algorithm, "group_size", 0) or 0) < 2:
                raise RecipeError(f"{name}.algorithm.group_size must be >= 2 (group-relative advantages)")
            self.side_algorithms[name] = algorithm
            if not frozen[name]:
                self.backend_cfgs[name] = backend_configs(block.backend, algorithm, workers, where=f"{name}.backend")
        self.rewrites_per_prompt = int(self.side_algorithms[TEXT_SIDE].group_size)
        self.images_per_rewrite = int(self.side_algorithms[IMAGE_SIDE].group_size)
        self.group_size = self.rewrites_per_prompt * self.images_per_rewrite
        per_rank = {TEXT_SIDE: self.prompts_per_step // workers * self.rewrites_per_prompt}
        per_rank[IMAGE_SIDE] = per_rank[TEXT_SIDE] * self.images_per_rewrite
        for name in self.trained_sides:
            try:
                instantiate(recipe[name].stack).check_shard_size(per_rank[name], workers)
            except ValueError as exc:
                raise RecipeError(f"{name}.stack: {exc} ({per_rank[name]} {'rewrites' if name == TEXT_SIDE else 'images'} "
                                  "per rank per step)") from None
        self.bundle_cfgs = {name: instantiate(recipe[name].bundle.config) if "config" in recipe[name].bundle else None
                            for name in SIDES}
        check_image_size(self.bundle_cfgs[IMAGE_SIDE], recipe[IMAGE_SIDE].pipeline, where=f"{IMAGE_SIDE}.pipeline")
        check_context_length(self.bundle_cfgs[TEXT_SIDE], recipe[TEXT_SIDE].pipeline, where=f"{TEXT_SIDE}.pipeline")
        self.dedicated = self.eval_source = self.algorithm = None
        self.engine_set = EngineSet({}, app_names={}, sections={}, feeds={}, seed=0)  # deployed by start_services
        self.sync = self._build("sync") if recipe.get("sync") is not None else None
        if self.engine_cfgs and self.sync is None:
            self.sync = TensorWeightSync()

    def engine_configs(self) -> dict[str, DedicatedRollout]:
        return dict(self.engine_cfgs)  # one per side that an engine app rolls out

    def is_demo(self) -> bool:
        return any(bool(getattr(c, "is_demo", False)) for c in self.bundle_cfgs.values())

    def make_credit(self) -> CreditAssignment:
        cfg = self.run_cfg
        return LineageCredit(text_stage=TEXT_SIDE, image_stage=IMAGE_SIDE, rewrite_reward=cfg.rewrite_reward,
                             image_group_scope=cfg.diffusion_group_scope, normalize_std=cfg.normalize_std)

    # -------------------------------------------------------------- workers
    def rank_sections(self, *, rollout: bool = True) -> dict[str, Any]:
        """``{"sides": {"ar": ..., "diffusion": ...}}``: a frozen side without backend / algorithm / stack."""
        sides = {}
        for name in SIDES:
            block = OmegaConf.to_container(self.recipe[name], resolve=True)
            drop = set() if name in self.trained_sides else set(TRAIN_SECTIONS)
            if not rollout or name in self.engine_cfgs:  # an engine app rolls this side out
                drop.add("rollout")
            sides[name] = {k: v for k, v in block.items() if k not in drop}
        return {"sides": sides}

    # -------------------------------------------------------------- services
    def start_services(self) -> None:
        """The reward app(s) and one engine app per side that rolls out on one (``<run>-rollout-<side>``, fed by
        that side's weights); they build while the train workers start, except colocated engines, which
        deploy and sleep first."""
        from unirl_ray.rewards import RewardClient

        if hasattr(self.data, "prefetch"):  # the prompts are read while the workers start
            self.data.prefetch()
        self.reward = self.engine = None
        self._stage_metrics = {}
        self._reward_deploy = _in_background("reward", RewardClient.deploy, self.reward_cfg,
                                             app_name=f"{self.run_cfg.run_name}-reward")
        self._mark_when_done(self._reward_deploy, "reward_app")
        names = list(self.engine_cfgs)
        self.engine_set = EngineSet(
            self.engine_cfgs, app_names={n: f"{self.run_cfg.run_name}-rollout-{n}" for n in names},
            sections={n: engine_sections(self.recipe[n], self.backend_cfgs[n]) for n in names},
            feeds={n: n for n in names}, seed=self.run_cfg.seed)
        self.engine_set.deploy()

    @property
    def engines(self) -> dict[str, DedicatedEngine]:
        return self.engine_set.engines

    def start_workers(self) -> dict[str, Any]:
        announced = BaseTrainer.start_workers(self)
        self.policy_version = dict(announced.get("policy_version") or {})
        self._await_reward()
        if self.engine_set.ready():  # engines start from the (restored) weights
            self.engine_set.push(self.sync, self.group, self.policy_version)
        return announced

    def await_engines(self) -> None:
        self.engine_set.ready()

    def engine_services(self) -> list[DedicatedEngine]:
        return list(self.engines.values())

    def after_restart(self, announced: dict[str, Any], restored_step: int) -> None:
        """The restarted workers hold the checkpoint's weights: adopt their versions, republish them to the engines."""
        self.policy_version = dict(announced.get("policy_version") or {})
        self.prompt_log = [(s, p) for s, p in self.prompt_log if s <= restored_step]
        if self.engines:
            self.engine_set.push(self.sync, self.group, self.policy_version)

    def sync_engines(self, step: int) -> dict[str, float]:
        """After training ``step``: publish each trained side's weights to its engine (versioned, verified)."""
        metrics: dict[str, float] = {}
        if not self.engines or not self.sync.due(step):
            return metrics
        self.quiesce_rollouts()
        for side, pushed in self.engine_set.push(self.sync, self.group, self.policy_version).items():
            metrics |= {f"{side}/{k}": v for k, v in pushed.items() if k != "weight_sync/engines"}
        metrics["timing/weight_sync"] = sum(v for k, v in metrics.items() if k.endswith("/weight_sync/seconds"))
        return metrics

    # ------------------------------------------------------------- one step
    def collect(self, step: int) -> tuple[list[Sample], dict[str, Any]]:
        """prompts -> rewrites (ar side) -> images (diffusion side) -> rewards; one Sample per image."""
        rows = self.data.next_batch(self.prompts_per_step)
        self.prompt_log.append((step, [row["prompt"] for row in rows]))
        seed, n, m = self.run_cfg.seed, self.rewrites_per_prompt, self.images_per_rewrite

        self.side_metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        asks = []
        for p, row in enumerate(rows):
            columns = {k: v for k, v in row.items() if k != "prompt"}
            for r in range(n):
                asks.append({"sample_id": f"s{step}-p{p}-r{r}", "group_id": f"s{step}-p{p}",
                             "prompt": self.rewrite.ask(row["prompt"]), "columns": columns,
                             "original": row["prompt"],
                             "seed": derive_seed(seed, "rewrite", step, p * n + r),
                             "group_seed": derive_seed(seed, "rewrite-group", step, p)})
        written = self._generate(TEXT_SIDE, asks)
        self._rewrite_versions = {t.sample_id: t.policy_version for t in written}
        t1 = time.perf_counter()

        cleaned, draws = [], []
        for ask, text in zip(asks, written):
            rewrite, fell_back = self.rewrite.clean(routed_part(text, TextPart, TEXT_SIDE).text, ask["original"])
            cleaned.append((rewrite, fell_back))
            for i in range(m):
                draws.append({"sample_id": f"{ask['sample_id']}-i{i}", "group_id": ask["group_id"], "prompt": rewrite,
                              "columns": ask["columns"],
                              "seed": derive_seed(seed, "image", step, ask["sample_id"], i),
                              "group_seed": derive_seed(seed, "group", step, ask["group_id"])})
        drawn = self._generate(IMAGE_SIDE, draws)
        t2 = time.perf_counter()

        samples = []
        for k, image in enumerate(drawn):
            ask, text, (rewrite, _) = asks[k // m], written[k // m], cleaned[k // m]
            rewrite_part = dataclasses.replace(routed_part(text, TextPart, TEXT_SIDE), part_id=text.sample_id)
            samples.append(Sample(
                sample_id=image.sample_id, group_id=ask["group_id"],
                prompt=ask["original"] if self.image_prompt == "original" else rewrite,
                columns={**ask["columns"], "original_prompt": ask["original"], "rewrite": rewrite,
                         "completions": rewrite_part.text},
                parts=[rewrite_part, routed_part(image, DiffusionPart, IMAGE_SIDE)],
                image=image.image, policy_version=image.policy_version,
            ))
        if len(samples) != len(rows) * n * m:
            raise RuntimeError(f"step {step}: {len(samples)} images for {len(rows)} prompts x {n} rewrites x {m}")
        fallback = [fb for _, fb in cleaned]
        chars = [len(r) for r, _ in cleaned]
        tokens = [_num_tokens(routed_part(t, TextPart, TEXT_SIDE)) for t in written]
        metrics = {
            "timing/rollout": t2 - t0, "timing/rollout_rewrite": t1 - t0, "timing/rollout_draw": t2 - t1,
            "pe/fallback_frac": float(np.mean(fallback)), "pe/rewrite_chars_mean": float(np.mean(chars)),
            "pe/rewrites": float(len(asks)), "pe/images": float(len(samples)),
            "rollout/response_len_mean": float(np.mean(tokens)), "rollout/response_len_max": float(np.max(tokens)),
        }
        metrics |= self.side_metrics
        lags = [self.policy_version.get(side, 0) - s.policy_version for side, group in ((TEXT_SIDE, written), (IMAGE_SIDE, drawn))
                for s in group]
        metrics["rollout/version_lag_max"] = float(max(lags, default=0))
        metrics |= self.reward.score(samples)
        return samples, metrics

    def _generate(self, side: str, requests: list[dict[str, Any]]) -> list[Sample]:
        """Side ``side`` samples ``requests``: on its engine app (full samples; a colocated engine takes its
        turn on the devices), else on the ranks in contiguous shards (rank r: shard r; light samples)."""
        clean = [{k: v for k, v in r.items() if k != "original"} for r in requests]
        engine = self.engines.get(side)
        if engine is not None:
            out = self.on_engine(engine, clean)
            if engine.colocated:
                self.side_metrics |= {f"{side}/{k}": v for k, v in self._stage_metrics.items()}
                self._stage_metrics = {}
            for sample in out:
                for part in sample.parts:
                    part.stage = side
        else:
            shards = _split(clean, self.group.world_size)
            results = self.group.call("generate", [{"requests": shard, "side": side} for shard in shards])
            out = [s for shard in results for s in shard]
        if [s.sample_id for s in out] != [r["sample_id"] for r in requests]:
            raise RuntimeError(f"the {side} side returned samples out of order or incomplete")
        return out

    def train(self, samples: list[Sample], *, seed: int) -> dict[str, float]:
        """Route every Part to its side (one Sample per rewrite for ``ar``, one per image for ``diffusion``), in
        the contiguous shards they were generated in (rank r trains what rank r made), train the unfrozen sides
        on every rank, and check the advantages each rank's Parts carried into its stacks."""
        world = self.group.world_size
        rewrites: dict[str, Sample] = {}
        images = []
        for s in samples:
            text, image = routed_part(s, TextPart, TEXT_SIDE), routed_part(s, DiffusionPart, IMAGE_SIDE)
            if text.part_id not in rewrites:
                rewrites[text.part_id] = Sample(sample_id=text.part_id, group_id=s.group_id, prompt=s.columns["rewrite"],
                                                parts=[dataclasses.replace(text, part_id=None)], reward=text.reward,
                                                policy_version=self._rewrite_versions[text.part_id])
            images.append(Sample(sample_id=s.sample_id, group_id=s.group_id, prompt=s.prompt, parts=[image],
                                 rewards=s.rewards, reward=s.reward, policy_version=s.policy_version))
        routed = {TEXT_SIDE: _split(list(rewrites.values()), world), IMAGE_SIDE: _split(images, world)}
        payload = [{"samples": {name: routed[name][r] for name in self.trained_sides}, "seed": seed} for r in range(world)]
        results = self.group.call("train", payload)
        for r, result in enumerate(results):
            for name in self.trained_sides:
                part_type = TextPart if name == TEXT_SIDE else DiffusionPart
                sent = [part_advantage(s, routed_part(s, part_type, name)) for s in routed[name][r]]
                got = result["advantages"][name]
                if got != sent:  # exactly: the same floats, in the same order
                    raise RuntimeError(f"rank {r} trained side {name!r} on other advantages than the driver assigned "
                                       f"(first: {got[:3]} vs {sent[:3]}): a Part's advantage was lost on the way")
        self.policy_version.update(results[0]["policy_version"])
        metrics = dict(results[0]["metrics"])
        metrics |= {f"{name}/train/policy_version": float(self.policy_version[name]) for name in self.trained_sides}
        metrics["pe/advantages_checked"] = float(sum(len(r["advantages"][n]) for r in results for n in self.trained_sides))
        return metrics

    def resume_safe_prefixes(self) -> tuple[str, ...]:
        """The single-side trainers' resume-safe keys, also under each side (``ar.stack.micro_batch_size``, ...)."""
        base = super().resume_safe_prefixes()
        per_side = tuple(f"{side}.{p}" for side in SIDES for p in base if p.startswith(("stack.", "rollout.")))
        return base + per_side

    # -------------------------------------------------------------- export
    def export(self, directory: str, *, side: str | None = None, **kwargs: Any) -> str:
        """``BaseTrainer.export`` of one side's model (``side``: ``ar`` or ``diffusion``, a trained one)."""
        if side not in self.trained_sides:
            raise ValueError(f"name the side to export: side={' or '.join(map(repr, self.trained_sides))} "
                             f"(got {side!r}; a frozen side has nothing trained to export)")
        return super().export(directory, side=side, **kwargs)

    def export_at_end(self) -> None:
        """``trainer.export_dir``: one ``from_pretrained`` folder per trained side (``<export_dir>/<side>``),
        registered as ``<export_register_as>-<side>`` when set."""
        cfg = self.run_cfg
        if cfg.export_dir is None:
            return
        from unirl_ray.train.export import is_previous_export

        for name in SIDES:  # an earlier export of a side this run keeps frozen would pass for this run's
            stale = os.path.join(cfg.export_dir, name)
            if name not in self.trained_sides and is_previous_export(stale):
                shutil.rmtree(stale)
        for name in self.trained_sides:
            directory = os.path.join(cfg.export_dir, name)
            register = f"{cfg.export_register_as}-{name}" if cfg.export_register_as else None
            self.export(directory, merge_lora=cfg.export_merge_lora, register_model_name=register,
                        overwrite=is_previous_export(directory), side=name)

    # ------------------------------------------------------------- logging
    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """A table (original prompt, rewrite, rewards and advantages per side) and an image grid with the rewrites."""
        shown = samples[:32]
        parts = [(routed_part(s, TextPart, TEXT_SIDE), routed_part(s, DiffusionPart, IMAGE_SIDE)) for s in shown]
        self.tracker.log_table(
            {
                "step": [step] * len(shown),
                "prompt": [s.columns["original_prompt"] for s in shown],
                "rewrite": [s.columns["rewrite"] for s in shown],
                "rewriter_text": [t.text for t, _ in parts],
                "reward": [s.reward for s in shown],
                "rewrite_reward": [t.reward for t, _ in parts],
                "ar_advantage": [t.advantage for t, _ in parts],
                "diffusion_advantage": [i.advantage for _, i in parts],
            },
            f"samples/step_{step:06d}.json",
        )
        drawn = [s for s in shown if s.image is not None][:16]
        captions = [f"{s.columns['rewrite']} | r={s.reward if s.reward is None else round(s.reward, 4)}" for s in drawn]
        if drawn:
            self.tracker.log_images(step, [s.image for s in drawn], captions, key="images")  # its own captions table
