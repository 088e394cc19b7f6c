"""``RLTrainer``: the single-stage RL step shared by the diffusion and AR trainers.

Layouts, as the seed describes them:

- **trainside / direct** (``rollout: TrainsideRollout``): the train ranks sample with the module
  they train; no engine, no sync; each rank trains on the samples it generated.
- **dedicated engine** (``rollout: DedicatedRollout``): a Ray Serve app generates, driven by a
  ``RolloutManager`` (``rollout.manager``: every dedicated rollout of every trainer goes through one,
  per engine: ``on_engine``); after every
  ``sync.every`` train steps the controller pushes versioned, verified weights to it
  (``TensorWeightSync``) and refuses to roll out with a stale engine. ``placement: colocated``
  makes engine and train workers take turns on the same devices (offload -> wake -> generate ->
  sleep -> onload, ``colocated_rollout``).

Each step, in order (``run_step``):

    prompts   -> data.next_batch(prompts_per_step), each prompt repeated group_size times
    rollout   -> trainside ranks or the engine app (log-probs recorded per step / token)
    reward    -> the reward app(s) (rule rewards in this process, reward models in Serve)
    credit    -> assign_credit: the algorithm's group-relative advantages by default (on the driver: groups
                 span ranks; ``algorithms.credit``)
    train     -> every rank trains on its shard (prepare_segment, mini-batches, optimizer steps)
    sync      -> dedicated engines only: publish the new version to every replica
    log       -> MLflow metrics (+ samples every ``tracking.log_samples_every`` steps)
    eval      -> every ``trainer.eval_every`` steps: held-out prompts, fixed seeds, EMA weights if any

Checkpoints and progress lines are ``BaseTrainer.run_steps``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from unirl_ray.algorithms.credit import CreditAssignment
from unirl_ray.config.recipe import RecipeError, instantiate, locate
from unirl_ray.core.sample import Sample
from unirl_ray.rollout.dedicated import DedicatedEngine, DedicatedRollout
from unirl_ray.rollout.manager import RolloutManager
from unirl_ray.runtime.serve import delete_apps
from unirl_ray.runtime.train_group import WorkerGroupRestarted
from unirl_ray.train.configs import BACKEND_CONFIG_TYPES, check_backend_config
from unirl_ray.trainer.base import BaseTrainer, RunConfig, console, derive_seed

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RLRunConfig(RunConfig):
    """The ``trainer:`` block of a single-stage RL recipe."""

    prompts_per_step: int = 4
    """Distinct prompts per step; each is sampled ``algorithm.group_size`` times."""
    eval_every: int = 0
    """Evaluate every N steps (and after the last step) on held-out prompts; 0: no evaluation during training."""
    eval_on_start: bool = False
    """Also evaluate before the first step (logged at step 0; not on a resume): the baseline the later
    evaluations are compared with."""
    eval_prompts: str | None = None
    """Held-out prompt file or folder (``data.path``'s formats and columns); None evaluates on ``data.path`` (warned)."""
    eval_num_prompts: int = 8
    """Prompts evaluated (the first N, file order), one sample each with seeds fixed across evaluations."""
    eval_with_ema: bool = True
    """Evaluate with the backend's EMA weights (``ema_full_cfg``, else the NFT shadow adapter) when it has one."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompts_per_step < 1:
            raise ValueError(f"trainer.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.eval_every < 0 or self.eval_num_prompts < 1:
            raise ValueError("trainer.eval_every must be >= 0 and trainer.eval_num_prompts >= 1, got "
                             f"{self.eval_every} and {self.eval_num_prompts}")


class RLTrainer(BaseTrainer):
    """Subclasses set ``domain`` and log their samples (``log_samples``)."""

    worker_sections = ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")
    driver_sections = ("trainer", "data", "reward", "tracking", "ray", "sync")

    def optional_sections(self) -> set[str]:
        return {"sync"}

    # ------------------------------------------------------------ validation
    def validate_domain(self) -> None:
        recipe = self.recipe
        self.prompts_per_step = self.run_cfg.prompts_per_step
        self.prompt_log: list[tuple[int, list[str]]] = []  # (step, prompts) trained in this process
        self.data = self._build("data")
        self.reward_cfg = self._build("reward")
        try:
            self.reward_cfg.check_learnable()
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
        if self.reward_cfg.image_prompt != "original":
            raise RecipeError(f"reward.image_prompt={self.reward_cfg.image_prompt!r} is for prompt-enhancer recipes "
                              f"(an image drawn from a rewrite); a {self.domain} recipe has one prompt per sample: drop it")
        self.algorithm = self.driver_algorithm()  # driver copy: advantages only (no pipeline)
        self.group_size = self.samples_per_prompt()
        stack = self._build("stack")
        self.bundle_cfg = instantiate(recipe.bundle.config) if "config" in recipe.bundle else None
        self.backend_cfgs = backend_configs(recipe.backend, self.algorithm, self.ray_cfg.num_workers)
        self.dedicated = self._dedicated_rollout()
        self.sync = self._build("sync") if recipe.get("sync") is not None else None
        if self.dedicated is not None and self.sync is None:
            from unirl_ray.rollout.weight_sync import TensorWeightSync

            self.sync = TensorWeightSync()
        total = self.prompts_per_step * self.group_size
        workers = self.ray_cfg.num_workers
        if total % workers:
            raise RecipeError(
                f"trainer.prompts_per_step x algorithm.group_size = {total} samples per step must divide evenly "
                f"over ray.scaling.num_workers={workers} (every FSDP rank must do the same work)"
            )
        try:
            stack.check_shard_size(total // workers, workers)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
        self.eval_source = self._eval_source()
        self.validate_model()

    def driver_algorithm(self) -> Any:
        """The driver's copy of the recipe's algorithm (credit assignment and checks; no pipeline)."""
        return self._build("algorithm")

    def samples_per_prompt(self) -> int:
        """Samples drawn per prompt each step: the algorithm's ``group_size``."""
        return int(getattr(self.algorithm, "group_size", 1))

    def _eval_source(self) -> Any:
        """The held-out prompts of ``trainer.eval_*`` (file order), or None when evaluation is off."""
        cfg = self.run_cfg
        if not (cfg.eval_every or cfg.eval_on_start):
            return None
        if cfg.eval_num_prompts % self.ray_cfg.num_workers:
            raise RecipeError(f"trainer.eval_num_prompts={cfg.eval_num_prompts} must divide evenly over "
                              f"ray.scaling.num_workers={self.ray_cfg.num_workers} (every rank samples the same number)")
        if cfg.eval_prompts is None:
            log.warning("trainer.eval_prompts is not set: evaluating on the first prompts of data.path (not held out)")
        data = OmegaConf.to_container(self.recipe.data, resolve=True)
        if "path" not in data:
            raise RecipeError("trainer.eval_every / eval_on_start need a data source with a path "
                              f"({data.get('_target_')} has none)")
        return instantiate({**data, "path": cfg.eval_prompts or data["path"], "shuffle": False})

    def _dedicated_rollout(self) -> DedicatedRollout | None:
        target = self.recipe.rollout.get("_target_")
        cls = locate(target, "rollout") if target else None
        if isinstance(cls, type) and issubclass(cls, DedicatedRollout):
            return self._build("rollout")
        return None

    def validate_model(self) -> None:
        """Family checks on the driver (e.g. resolution vs. the latent factor)."""

    def is_demo(self) -> bool:
        return bool(getattr(self.bundle_cfg, "is_demo", False))

    def extra_resources(self) -> dict[str, float]:
        need = self.reward_cfg.resources()
        for cfg in self.engine_configs().values():
            for key, value in cfg.resources().items():
                need[key] = need.get(key, 0.0) + value
        return need

    # -------------------------------------------------------------- services
    def engine_configs(self) -> dict[str, DedicatedRollout]:
        """The rollout engine apps this run deploys or attaches to, by name (empty when the train ranks roll
        out): their replicas count in ``extra_resources``, and the driver reaches them through Serve."""
        return {"rollout": self.dedicated} if self.dedicated is not None else {}

    def driver_libraries(self) -> tuple[str, ...]:
        serve = bool(self.engine_configs()) or self.reward_cfg.uses_serve()
        return (*super().driver_libraries(), *(("serve",) if serve else ()))

    def start_services(self) -> None:
        """Deploy the reward app(s) and a dedicated engine. Both build while the train workers start
        (``start_workers`` waits for them); only a colocated engine deploys (and sleeps) first, so
        that the workers find the devices free, and an attached engine app (``rollout.attach``) is checked
        before anything starts."""
        from unirl_ray.rewards import RewardClient

        self.reward = None
        self.engine = None
        self._engine_deploy: Future | None = None
        self._stage_metrics: dict[str, float] = {}
        deploy = None
        if self.dedicated is not None:
            deploy = functools.partial(DedicatedEngine.deploy, self.dedicated, app_name=self._engine_app_name(),
                                       sections=engine_sections(self.recipe, self.backend_cfgs), seed=self.run_cfg.seed)
            if self.dedicated.attach:  # a running app: checked first (quick), before anything else starts
                self.engine = deploy()
        for source in (self.data, self.eval_source):  # the prompts are read while the workers start
            if hasattr(source, "prefetch"):
                source.prefetch()
        self._reward_deploy: Future | None = _in_background(
            "reward", RewardClient.deploy, self.reward_cfg, app_name=f"{self.run_cfg.run_name}-reward")
        self._mark_when_done(self._reward_deploy, "reward_app")
        if deploy is not None and self.engine is None:
            if self.dedicated.placement == "colocated":
                self.engine = deploy()
                self.engine.sleep()  # give the devices to the train workers that start next
            else:  # a separate engine builds its model while the train workers start; start_workers waits
                self._engine_deploy = _in_background("engine", deploy)
                self._mark_when_done(self._engine_deploy, "engine")

    def _mark_when_done(self, future: Future, milestone: str) -> None:
        """Mark ``milestone`` on the start-up clock when a background deploy succeeds."""
        clock = getattr(self, "startup", None)
        if clock is not None:
            future.add_done_callback(lambda f: f.exception() is None and clock.mark(milestone))

    def _engine_app_name(self) -> str:
        return f"{self.run_cfg.run_name}-rollout"

    def _await_engine(self) -> DedicatedEngine | None:
        """The engine, once its background deploy is done (its error raised here); bounded by the
        deploy's own timeout, which deletes an app that never became ready."""
        future, self._engine_deploy = getattr(self, "_engine_deploy", None), None
        if future is not None:
            self.engine = future.result(timeout=self.dedicated.timeout_s + 120)
        return getattr(self, "engine", None)

    def _await_reward(self) -> Any:
        """The reward client, once its background deploy is done (its error raised here). Each of its
        apps is bounded by the deploy's own readiness timeout (which deletes an app that never got
        ready); this wait is a backstop over all of them."""
        future, self._reward_deploy = getattr(self, "_reward_deploy", None), None
        if future is not None:
            self.reward = future.result(timeout=REWARD_DEPLOY_TIMEOUT_S)
        return getattr(self, "reward", None)

    def rank_sections(self, *, rollout: bool = True) -> dict[str, Any]:
        return super().rank_sections(rollout=rollout and self.dedicated is None)  # an engine rolls out: ranks only train

    def start_workers(self) -> dict[str, Any]:
        announced = super().start_workers()
        self.policy_version = int(announced.get("policy_version", 0))
        self._await_reward()
        if self._await_engine() is not None:  # the engine starts from the trainer's (possibly restored) weights
            self.sync.push(self.group, self.engine, self.policy_version)
        return announced

    def stop_services(self) -> None:
        """Wait for deploys still running (setup failed), then shut the engine app(s) and the reward app(s) down."""
        try:
            self.await_engines()
        except Exception as exc:  # noqa: BLE001 - setup already failed; a failed deploy leaves no app
            log.warning("a rollout engine's deploy failed: %s", exc)
        try:
            self._await_reward()
        except Exception as exc:  # noqa: BLE001 - setup already failed; the deploy removes an app that never got ready
            log.warning("the reward app's deploy failed: %s", exc)
        for manager in getattr(self, "_managers", {}).values():
            manager.shutdown()
        self._managers = {}
        services = [s for s in [*self.engine_services(), getattr(self, "reward", None)] if s is not None]
        try:  # every app at once (each deletion waits for its replicas to stop), then each service's own cleanup
            delete_apps([name for s in services for name in s.app_names()])
        except Exception as exc:  # noqa: BLE001 - each shutdown below deletes its own apps again, and says so
            log.warning("deleting this run's Serve apps: %s", exc)
        for service in services:
            service.shutdown()

    def await_engines(self) -> None:
        """Wait for the engine's background deploy; one that failed is deleted and its error raised."""
        try:
            self._await_engine()
        except Exception:
            try:
                delete_apps([self._engine_app_name()])
            except Exception:  # noqa: BLE001 - best effort
                pass
            raise

    def engine_services(self) -> list[DedicatedEngine]:
        """The deployed engine apps of this run."""
        engine = getattr(self, "engine", None)
        return [] if engine is None else [engine]

    def after_restart(self, announced: dict[str, Any], restored_step: int) -> None:
        """The restarted workers hold the checkpoint's weights: adopt its version, republish it to the engine."""
        self.policy_version = int(announced.get("policy_version", 0))
        self.prompt_log = [(s, p) for s, p in self.prompt_log if s <= restored_step]
        if self.engine is not None:
            self.sync.push(self.group, self.engine, self.policy_version)
            self.published(self.policy_version)

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("data"):
            self.data.load_state_dict(state["data"])

    def controller_state(self) -> dict[str, Any]:
        return {**super().controller_state(), "data": self.data.state_dict()}

    # ------------------------------------------------------------- one step
    def run_step(self, step: int) -> dict[str, Any]:
        t_step = time.perf_counter()
        samples, metrics = self.collect(step)
        return self.learn(step, samples, metrics, t_step)

    def collect(self, step: int) -> tuple[list[Sample], dict[str, Any]]:
        """This step's scored samples: prompts -> rollout -> reward (the async trainers take them from a stream)."""
        rows = self.data.next_batch(self.prompts_per_step)
        self.prompt_log.append((step, [row["prompt"] for row in rows]))
        requests = self.make_requests(step, rows)

        t0 = time.perf_counter()
        samples = self.rollout(requests)
        metrics = {"timing/rollout": time.perf_counter() - t0, **self.rollout_metrics(samples)}
        metrics |= self._stage_metrics
        self._stage_metrics = {}
        metrics |= self.reward.score(samples)
        return samples, metrics

    def learn(self, step: int, samples: list[Sample], metrics: dict[str, Any], t_step: float) -> dict[str, Any]:
        """credit assignment -> train -> weight sync -> timings, sample logging and evaluation."""
        metrics |= self.assign_credit(step, samples)

        t0 = time.perf_counter()
        metrics |= self.train(samples, seed=derive_seed(self.run_cfg.seed, "train", step))
        metrics["timing/train"] = time.perf_counter() - t0

        metrics |= self.sync_engines(step)

        metrics["timing/step"] = time.perf_counter() - t_step
        metrics["perf/samples_per_s"] = len(samples) / metrics["timing/step"]
        if self.tracker.should_log_samples(step):
            self.log_samples(step, samples)
        if self.eval_due(step):
            metrics |= self.evaluate(step)
        return metrics

    def eval_due(self, step: int) -> bool:
        """Whether ``step`` ends with an evaluation: every ``eval_every`` steps and after the last one."""
        if self.eval_source is None:  # evaluation off (or a trainer without it: the prompt enhancer)
            return False
        every = self.run_cfg.eval_every
        return every > 0 and (step % every == 0 or step == self.run_cfg.num_steps)

    def run_steps(self, start_step: int) -> dict[str, Any]:
        if self.eval_source is not None and self.run_cfg.eval_on_start and start_step == 0:
            self.evaluate_baseline()
        return super().run_steps(start_step)

    def evaluate_baseline(self) -> None:
        """``trainer.eval_on_start``: the evaluation before the first step, logged at step 0, once per fit (a
        worker group restarted during it is recovered and the evaluation run again, as during a step)."""
        if getattr(self, "_baseline_logged", False):
            return
        while True:
            try:
                metrics = self.evaluate(0)
                break
            except WorkerGroupRestarted as exc:
                self.recover(0, exc)
        self.tracker.log_metrics(metrics, step=0)
        self._baseline_logged = True
        console(f"step 0/{self.run_cfg.num_steps} (before training) | eval reward {metrics['eval/reward_mean']:.4f}")

    def assign_credit(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """The credit-assignment stage (``algorithms.credit``): every sample's (and Part's) advantage."""
        if getattr(self, "credit", None) is None:
            self.credit = self.make_credit()
        return self.credit(step, samples)

    def make_credit(self) -> CreditAssignment:
        """This trainer's credit assignment: by default the algorithm's ``compute_advantages``."""
        return CreditAssignment(self.algorithm)

    def sync_engines(self, step: int) -> dict[str, float]:
        """After training ``step``: publish the weights to the dedicated engine when a sync is due."""
        if self.engine is not None and self.sync.due(step):
            self.quiesce_rollouts()
            return self.publish_weights()
        return {}

    def quiesce_rollouts(self) -> None:
        """Before a weight sync: no engine call of any of this run's RolloutManagers is in flight."""
        for manager in getattr(self, "_managers", {}).values():
            manager.quiesce()

    def publish_weights(self) -> dict[str, float]:
        """Push the trained weights to every engine replica and verify them (the barrier); returns metrics."""
        metrics = self.sync.push(self.group, self.engine, self.policy_version)
        metrics["timing/weight_sync"] = metrics["weight_sync/seconds"]
        self.published(self.policy_version)
        return metrics

    def published(self, version: int) -> None:
        """Called after every replica of the engine serves ``version`` (verified)."""

    def make_requests(self, step: int, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each prompt ``group_size`` times, with a per-sample seed fixed by (seed, step, index)."""
        requests = []
        for p, row in enumerate(rows):
            columns = {k: v for k, v in row.items() if k != "prompt"}
            for g in range(self.group_size):
                index = p * self.group_size + g
                requests.append({
                    "sample_id": f"s{step}-{index}",
                    "group_id": f"s{step}-p{p}",
                    "prompt": row["prompt"],
                    "columns": columns,
                    "seed": derive_seed(self.run_cfg.seed, "sample", step, index),
                    "group_seed": derive_seed(self.run_cfg.seed, "group", step, p),
                })
        return requests

    def rollout(self, requests: list[dict[str, Any]]) -> list[Sample]:
        if self.engine is not None:
            return self.on_engine(self.engine, requests)
        shards = _split(requests, self.group.world_size)
        results = self.group.call("generate", [{"requests": shard} for shard in shards])
        return [sample for shard in results for sample in shard]

    def rollout_manager(self, engine: DedicatedEngine) -> RolloutManager:
        """The RolloutManager of ``engine`` (one per engine app, built by ``make_manager`` on first use)."""
        managers = self.__dict__.setdefault("_managers", {})
        key = engine.app_name
        if key not in managers:
            managers[key] = self.make_manager(engine)
        return managers[key]

    def make_manager(self, engine: DedicatedEngine) -> RolloutManager:
        """A single-turn RolloutManager (the agentic trainer's runs trajectories)."""
        return RolloutManager(engine)

    def on_engine(self, engine: DedicatedEngine, requests: list[dict[str, Any]], *, trajectories: bool = False) -> list[Any]:
        """``requests`` rolled out on ``engine`` through its RolloutManager (``generate``, or ``run`` for whole
        trajectories); a colocated engine takes its turn on the devices (``colocated_rollout``)."""
        manager = self.rollout_manager(engine)
        generate = manager.run if trajectories else manager.generate
        if engine.colocated:
            return self.colocated_rollout(requests, engine, generate=generate)
        return generate(requests)

    def colocated_rollout(self, requests: list[dict[str, Any]], engine: DedicatedEngine, *, generate: Any) -> list[Any]:
        """Train workers and ``engine`` take turns on the same devices: workers offload, the engine wakes
        (loading the latest version, verified), ``generate(requests)`` runs (its RolloutManager's) and the engine
        sleeps, the workers onload. The turn's timings and bytes are left in ``self._stage_metrics``."""
        t0 = time.perf_counter()
        offloaded = self.group.call("offload", {})
        self._stage_metrics = {"colocate/train_bytes_offloaded": float(sum(r["bytes"] for r in offloaded)),
                               "colocate/train_bytes_resident": float(sum(r["resident_bytes"] for r in offloaded))}
        try:
            self._stage_metrics["timing/engine_wake"] = engine.wake()["seconds"]
            t1 = time.perf_counter()
            samples = generate(requests)
            self._stage_metrics["timing/engine_generate"] = time.perf_counter() - t1
            asleep = engine.sleep()
            self._stage_metrics |= {"timing/engine_sleep": asleep["seconds"], "colocate/engine_bytes_freed": asleep["bytes"]}
        finally:
            self.group.call("onload", {})
        self._stage_metrics["timing/offload_onload"] = time.perf_counter() - t0 - sum(
            self._stage_metrics.get(k, 0.0) for k in ("timing/engine_wake", "timing/engine_generate", "timing/engine_sleep"))
        return samples

    def rollout_metrics(self, samples: list[Sample]) -> dict[str, float]:
        """Family metrics of a rollout (lengths, ...); the policy-version lag of the samples."""
        lag = [self.policy_version - s.policy_version for s in samples]
        return {"rollout/version_lag_max": float(max(lag, default=0))}

    def train(self, samples: list[Sample], *, seed: int) -> dict[str, float]:
        """Send every rank its shard (without media); returns the reduced metrics."""
        shards = _split([dataclasses.replace(s, image=None) for s in samples], self.group.world_size)
        results = self.group.call("train", [{"samples": shard, "seed": seed} for shard in shards])
        self.policy_version = int(results[0]["policy_version"])
        return dict(results[0]["metrics"], **{"train/policy_version": self.policy_version})

    def log_samples(self, step: int, samples: list[Sample]) -> None:
        """Log media or text of this step's samples."""

    # ------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out prompts, one sample each with seeds fixed across evaluations, generated by the train
        ranks with the EMA weights when the backend has an EMA (and ``eval_with_ema``; the training
        weights are swapped back bit for bit), scored by the reward apps; metrics under ``eval/``."""
        t0 = time.perf_counter()
        use_ema = self.run_cfg.eval_with_ema and bool({"ema_full_cfg", "ema_lora_cfg"} & set(self.backend_cfgs))
        shards = _split(self.eval_requests(), self.group.world_size)
        results = self.group.call("eval_generate", [{"requests": shard, "use_ema": use_ema} for shard in shards])
        samples = [sample for shard in results for sample in shard]
        scored = self.reward.score(samples)
        metrics = {"eval/reward_mean": scored["reward/mean"], "eval/reward_std": scored["reward/std"],
                   "eval/ema": float(use_ema)}
        metrics |= {f"eval/{k}": v for k, v in scored.items() if k.startswith("reward/") and k.count("/") == 2}
        self.log_eval(step, samples)
        metrics["timing/eval"] = time.perf_counter() - t0
        return metrics

    def eval_requests(self) -> list[dict[str, Any]]:
        """The first ``eval_num_prompts`` eval prompts, with seeds that depend on the index only."""
        if len(self.eval_source) < self.run_cfg.eval_num_prompts:
            raise ValueError(f"trainer.eval_num_prompts={self.run_cfg.eval_num_prompts} but the eval prompts "
                             f"({self.eval_source.path}) hold only {len(self.eval_source)}")
        rows = [dict(r) for r in self.eval_source.open()._rows[: self.run_cfg.eval_num_prompts]]  # noqa: SLF001
        return [{"sample_id": f"eval-{i}", "group_id": f"eval-{i}", "prompt": row.pop("prompt"),
                 "columns": {k: v for k, v in row.items() if k != "row_index"},
                 "seed": derive_seed(self.run_cfg.seed, "eval", i),
                 "group_seed": derive_seed(self.run_cfg.seed, "eval-group", i)} for i, row in enumerate(rows)]

    def log_eval(self, step: int, samples: list[Sample]) -> None:
        """Log media or text of an evaluation's samples (under ``eval``)."""


def engine_sections(block: Any, backend_cfgs: dict[str, Any]) -> dict[str, Any]:
    """What a dedicated engine app builds for a side (``block``: the recipe, or a PE side's block): its
    bundle and pipeline, the adapter structure it must mirror (the trained LoRA; EmaLora: its default
    adapter) and the attribute that holds the trained module."""
    lora = None
    if block.backend.get("lora_cfg") is not None:
        lora = OmegaConf.to_container(block.backend.lora_cfg, resolve=True)
    elif backend_cfgs.get("ema_lora_cfg") is not None:
        lora = {"_target_": "unirl_ray.train.configs.LoraConfig", **dataclasses.asdict(backend_cfgs["ema_lora_cfg"].lora())}
    return {"bundle": OmegaConf.to_container(block.bundle, resolve=True),
            "pipeline": OmegaConf.to_container(block.pipeline, resolve=True),
            "lora_cfg": lora, "trainable_attr": block.backend.trainable_attr}


def backend_configs(backend: Any, algorithm: Any, num_workers: int, where: str = "backend") -> dict[str, Any]:
    """The backend section's configs, built on the driver (``{name: config}`` of those set), checked against
    the algorithm and the worker count; ``RecipeError`` naming ``where`` when they do not fit together."""
    cfgs = {name: instantiate(backend[name]) for name in BACKEND_CONFIG_TYPES if backend.get(name) is not None}
    for name, value in cfgs.items():
        try:
            check_backend_config(name, value, where)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
    for alg in algorithm.values() if isinstance(algorithm, dict) else [algorithm]:  # {stage: algorithm} too
        if getattr(alg, "needs_shadow_policy", False) and "ema_lora_cfg" not in cfgs:
            raise RecipeError(f"algorithm {type(alg).__name__} trains against the EMA shadow adapter (its old "
                              f"policy): set {where}.ema_lora_cfg (_target_: unirl_ray.train.configs.EmaLoraConfig)")
    if "lora_cfg" in cfgs and "ema_lora_cfg" in cfgs:
        raise RecipeError(f"{where}.lora_cfg and {where}.ema_lora_cfg are both set: EmaLoraConfig already injects "
                          "the LoRA adapters (plus their EMA shadow); keep only ema_lora_cfg")
    if "fsdp_cfg" in cfgs:
        try:
            cfgs["fsdp_cfg"].mesh_shape(num_workers)
        except ValueError as exc:
            raise RecipeError(f"{where}.fsdp_cfg: {exc}") from None
    return cfgs


def _split(items: list[Any], parts: int) -> list[list[Any]]:
    size = len(items) // parts
    return [items[i * size : (i + 1) * size] for i in range(parts)]


REWARD_DEPLOY_TIMEOUT_S = 900.0
"""Backstop on waiting for the reward apps' deploy (each app has its own 120 s readiness timeout)."""

def _in_background(what: str, fn: Any, *args: Any, **kwargs: Any) -> Future:
    """``fn(*args, **kwargs)`` in a thread of its own (a Serve deploy that mostly waits on replicas)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=f"unirl-{what}-deploy")
    try:
        return pool.submit(fn, *args, **kwargs)
    finally:
        pool.shutdown(wait=False)
