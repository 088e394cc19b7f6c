"""Facilities every domain trainer shares: validation, Ray, tracking, resume, progress, teardown.

A domain trainer subclasses ``BaseTrainer``, declares its recipe sections, validates what only it
knows (``validate_domain``) and writes ``run_steps``: the stage order, top to bottom.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from unirl_ray.config.recipe import RecipeError, flatten, instantiate, to_yaml, validate_targets
from unirl_ray.runtime import run_lock
from unirl_ray.runtime.cluster import RayConfig, add_driver_import_paths, check_cluster_fits, ensure_ray
from unirl_ray.runtime.train_group import TrainGroup, WorkerGroupRestarted
from unirl_ray.tracking import MLflowTracker, TrackingConfig
from unirl_ray.tracking.mlflow_tracker import check_tracking_store, is_uri

log = logging.getLogger(__name__)
RECIPE_FILE = "unirl_recipe.yaml"  # in the run folder: the recipe the run was first written with
FINISHED_FILE = "unirl_finished.json"  # in the run folder: the step budget of the last finished fit
RESUME_SAFE_PREFIXES = (  # recipe keys a resumed run may change: they do not change what is trained
    "trainer.num_steps", "trainer.checkpoint_every", "trainer.export_", "trainer.resume_changed_recipe",
    "trainer.eval_",  # what is evaluated, and how often: never what is trained
    "trainer.steps_per_call",  # SFT: steps per command to the workers; results do not depend on it
    "trainer.storage_path", "tracking.", "ray.", "stack.micro_batch_size",
    "reward.timeout_s", "reward.max_retries", "reward.num_replicas", "reward.ray_actor_options",
    "reward.max_ongoing_requests", "rollout.num_replicas", "rollout.ray_actor_options", "rollout.timeout_s",
    "rollout.max_retries",
)
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # never "." or "..": one safe path component


@dataclass(kw_only=True)
class RunConfig:
    """The ``trainer:`` block shared by all domains."""

    run_name: str
    """Name of the run: same name + same storage_path resumes it."""
    num_steps: int
    """RL steps to train (one rollout batch each)."""
    seed: int = 0
    """Seed of every random choice (sampling noise, shuffles); re-runs of a step are identical."""
    storage_path: str = "~/unirl_runs"
    """Root folder (or URI) of checkpoints, the local MLflow store and run files."""
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (and always after the last step)."""
    export_dir: str | None = None
    """After the last step, write the trained model here as a ``from_pretrained`` folder (replacing an earlier export)."""
    export_merge_lora: bool = True
    """With LoRA: merge the adapters into the exported weights; false writes base weights + a PEFT adapter."""
    export_register_as: str | None = None
    """Also log the export to the MLflow run and register it as a new version of this registered model."""
    resume_changed_recipe: bool = False
    """Resume a run even though its recipe differs from the one it was written with in keys that change
    what is trained (they are listed at start). Without it such a resume is refused; the step budget,
    checkpointing, export, tracking, Ray resources and replica counts may always change."""

    def __post_init__(self) -> None:
        if not isinstance(self.run_name, str) or not _RUN_NAME.fullmatch(self.run_name):
            raise ValueError(
                f"trainer.run_name must be one folder name: letters, digits, '.', '_' or '-', starting with a letter or "
                f"digit, at most 128 characters (it names the run's folder, Serve apps and MLflow run), got {self.run_name!r}"
            )
        if self.num_steps < 1:
            raise ValueError(f"trainer.num_steps must be >= 1, got {self.num_steps}")
        if self.checkpoint_every < 1:
            raise ValueError(f"trainer.checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if not is_uri(self.storage_path):
            self.storage_path = os.path.abspath(os.path.expanduser(self.storage_path))
        self._check_export_options()

    def _check_export_options(self) -> None:
        from unirl_ray.train.export import check_export_dir

        if self.export_dir is None:
            if self.export_register_as is not None:
                raise ValueError("trainer.export_register_as needs trainer.export_dir (the folder to export and register)")
            if not self.export_merge_lora:
                log.warning("trainer.export_merge_lora=false is ignored: trainer.export_dir is not set")
            return
        # an earlier export of this folder (a finished run started again) is replaced; anything else is refused
        try:
            self.export_dir = check_export_dir(self.export_dir, overwrite=self.holds_previous_export(self.export_dir))
        except ValueError as exc:
            raise ValueError(f"trainer.export_dir: {str(exc).split('; pass overwrite')[0]}. Set trainer.export_dir to an "
                             "empty or new folder (an earlier export of this project there is replaced)") from None
        if not is_uri(self.storage_path):
            run_dir = os.path.join(self.storage_path, self.run_name)
            if os.path.commonpath([self.export_dir, run_dir]) == run_dir:
                raise ValueError(f"trainer.export_dir={self.export_dir} is inside the run folder {run_dir}, which Ray "
                                 "Train manages (checkpoints rotate there); set trainer.export_dir outside it")
        if self.export_register_as is not None and not str(self.export_register_as).strip():
            raise ValueError("trainer.export_register_as must be a registered model name or null")

    @staticmethod
    def holds_previous_export(directory: str) -> bool:
        """Whether ``directory`` holds an earlier export of this kind of run (replaced by the next one)."""
        from unirl_ray.train.export import is_previous_export

        return is_previous_export(directory)


def _event_loop_running() -> bool:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def derive_seed(*parts: Any) -> int:
    """A stable 31-bit seed from any tuple of values (same on every machine and Python run)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class BaseTrainer(ABC):
    """Shared lifecycle; subclasses set ``domain``, ``worker_sections`` and implement the steps."""

    domain = "base"
    worker_sections: tuple[str, ...] = ()
    """Recipe sections the train workers build (bundle, pipeline, backend, ...)."""
    rank_class: str | None = None
    """Dotted path of the rank object the train workers build (None: ``train.rank.StackWorker``)."""
    driver_sections: tuple[str, ...] = ("trainer", "ray", "tracking")

    def __init__(self, recipe: DictConfig, *, allowed_target_prefixes: list[str] | None = None) -> None:
        self.recipe = recipe
        expected = set(self.worker_sections) | set(self.driver_sections)
        unknown = sorted(set(recipe.keys()) - expected)
        if unknown:
            raise RecipeError(f"recipe has sections {unknown} that a {self.domain} recipe does not use; expected {sorted(expected)}")
        missing = sorted(s for s in expected if s not in recipe or recipe[s] is None)
        missing = [s for s in missing if s not in self.optional_sections()]
        if missing:
            raise RecipeError(f"recipe lacks the sections {missing} (a {self.domain} recipe needs {sorted(expected)})")
        if allowed_target_prefixes is None:  # a shared cluster sets $UNIRL_ALLOWED_TARGET_PREFIXES instead
            from unirl_ray.config.recipe import allowed_prefixes_from_env

            allowed_target_prefixes = allowed_prefixes_from_env()
        ray_section = recipe.get("ray")
        add_driver_import_paths(ray_section.get("runtime_env") if ray_section is not None else None)  # your modules
        validate_targets(recipe, allowed_target_prefixes=allowed_target_prefixes)
        self.run_cfg: RunConfig = self._build("trainer")
        self.ray_cfg: RayConfig = self._build("ray")
        self.tracking_cfg: TrackingConfig = self._build("tracking")
        try:
            check_tracking_store(self.tracking_cfg, self.run_cfg.storage_path)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None
        self.tracker = MLflowTracker(self.tracking_cfg)
        self.group: TrainGroup | None = None
        self._run_lock: Any = None
        self.validate_domain()

    def optional_sections(self) -> set[str]:
        return set()

    def _build(self, section: str, **kwargs: Any) -> Any:
        return instantiate(self.recipe[section], **kwargs)

    def validate_domain(self) -> None:
        """Domain checks on the driver, before any worker starts (raise ``RecipeError``)."""

    def extra_resources(self) -> dict[str, float]:
        """Resources of Serve apps etc. that must fit next to the train workers."""
        return {}

    # -------------------------------------------------------------- lifecycle
    def fit(self) -> dict[str, Any]:
        """Run (or resume) the job to ``num_steps``; returns the last step's metrics.

        Inside a running asyncio loop (a Jupyter cell) the run happens in a worker thread, because
        Ray Serve's blocking handle calls refuse to run on an event-loop thread.
        """
        if _event_loop_running():
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fit-{self.domain}") as pool:
                return pool.submit(self._fit).result()
        return self._fit()

    def _fit(self) -> dict[str, Any]:
        done = self._finished_steps()
        if done is not None and done >= self.run_cfg.num_steps:
            console(f"{self.run_cfg.run_name} already finished {done}/{self.run_cfg.num_steps} steps under "
                    f"{self.run_cfg.storage_path}: nothing to do (raise trainer.num_steps to train on, or choose "
                    "another trainer.run_name for a new run)")
            return {}
        status = "FAILED"
        try:
            last = self.commit_last(self.run_steps(self.setup()))
            self.export_at_end()
            status = "FINISHED"
            self._mark_finished()
            return last
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self.teardown(status)

    # ------------------------------------------------------- the run folder
    def _local_run_dir(self) -> str | None:
        """The run's folder when the storage is local (run files are not read from remote storage)."""
        cfg = self.run_cfg
        return None if is_uri(cfg.storage_path) else os.path.join(cfg.storage_path, cfg.run_name)

    def _finished_steps(self) -> int | None:
        run_dir = self._local_run_dir()
        try:
            with open(os.path.join(run_dir, FINISHED_FILE)) as f:
                return int(json.load(f)["num_steps"])
        except (TypeError, OSError, ValueError, KeyError):
            return None

    def _mark_finished(self) -> None:
        run_dir = self._local_run_dir()
        if run_dir is not None and os.path.isdir(run_dir):
            with open(os.path.join(run_dir, FINISHED_FILE), "w") as f:
                json.dump({"num_steps": self.run_cfg.num_steps}, f)

    def check_resumed_recipe(self) -> None:
        """A run folder keeps the recipe it was first written with (``unirl_recipe.yaml``, see
        ``_record_recipe``). Resuming a run that has a checkpoint with a recipe that differs in what is
        trained is refused (a new ``trainer.run_name`` is what the user meant, or
        ``trainer.resume_changed_recipe=true``). A run without a checkpoint yet may start over changed."""
        run_dir = self._local_run_dir()
        if run_dir is None or not self._has_checkpoint(run_dir):
            return
        path = os.path.join(run_dir, RECIPE_FILE)
        if not os.path.isfile(path):
            return
        with open(path) as f:
            written = flatten(yaml.safe_load(f) or {})
        now = flatten(self.recipe)
        changed = [k for k in sorted(set(written) | set(now))
                   if written.get(k) != now.get(k) and not k.startswith(self.resume_safe_prefixes())]
        if not changed:
            return
        shown = "; ".join(f"{k}: {written.get(k, '(absent)')} -> {now.get(k, '(absent)')}" for k in changed[:8])
        more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
        origin = _recipe_origin(written)
        if origin != _recipe_origin(now):
            shown = f"this run was written by {origin}; {shown}"
        if self.run_cfg.resume_changed_recipe:
            log.warning("resuming %s with a changed recipe (trainer.resume_changed_recipe=true): %s%s",
                        self.run_cfg.run_name, shown, more)
            return
        raise RecipeError(
            f"run {self.run_cfg.run_name!r} under {self.run_cfg.storage_path} was written with another recipe, and "
            f"resuming it would train something else: {shown}{more}. For a new run set trainer.run_name=<new name>; "
            f"to resume anyway, +trainer.resume_changed_recipe=true (the recipe it started with: {path})"
        )

    def resume_safe_prefixes(self) -> tuple[str, ...]:
        """Recipe keys (prefixes) a resumed run may change (``RESUME_SAFE_PREFIXES``)."""
        return RESUME_SAFE_PREFIXES

    @staticmethod
    def _has_checkpoint(run_dir: str) -> bool:
        """Whether the run folder holds a checkpoint: a committed one, or one with rank 0's state file (a run from
        before the commit marker, whose checkpoint Ray Train registered; or, rarely, a save killed between its
        state file and its marker, which counts too); a folder a killed first save left without one does not
        (the run starts over, and may do so with a changed recipe)."""
        if not (os.path.isdir(run_dir) and any(n.startswith("checkpoint_") for n in os.listdir(run_dir))):
            return False  # (a new run: nothing more to ask)
        import pyarrow.fs

        from unirl_ray.runtime.checkpoint_layout import checkpoint_folders

        return any(f.committed or f.has_state for f in checkpoint_folders(pyarrow.fs.LocalFileSystem(), run_dir))

    def _record_recipe(self) -> None:
        """Write the recipe into the run folder while the run has no checkpoint (its first start, or a
        start that failed before one); once it has, the file is what ``check_resumed_recipe`` compares with."""
        run_dir = self._local_run_dir()
        if run_dir is None or self._has_checkpoint(run_dir):
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, RECIPE_FILE), "w") as f:
            f.write(to_yaml(self.recipe))

    def setup(self) -> int:
        """Join Ray, deploy services, start the workers, open tracking; returns the last done step.

        Each milestone is marked on ``self.startup`` (``runtime.startup``); ``run_steps`` logs them after the
        first step."""
        from unirl_ray.runtime.startup import StartupClock

        self.startup = StartupClock()
        self.startup.mark("setup")
        self.check_resumed_recipe()  # before Ray: a changed recipe never starts anything
        where = self._local_run_dir()
        shown = os.environ.get("UNIRL_PRINT_RECIPE") == "1"
        console(f"{self.domain} run {self.run_cfg.run_name}: the resolved recipe is "
                + (f"{os.path.join(where, RECIPE_FILE)} and " if where else "")
                + "recipe.yaml in its MLflow run" + ("" if shown else " (UNIRL_PRINT_RECIPE=1 prints it here)"))
        if shown:
            print(f"--- resolved recipe ({self.domain}) ---\n{to_yaml(self.recipe)}---", flush=True)
        log.info("running on %s (driver python: %s)", ensure_ray(self.ray_cfg, prefetch=self.driver_libraries()),
                 sys.executable)
        self.startup.mark("ray")
        check_cluster_fits(self.ray_cfg, self.extra_resources())
        # one live job per run name (its apps, store, folder); the lock actor is also the workers' command broker
        self._run_lock = run_lock.acquire(self.run_cfg.run_name, world_size=self.ray_cfg.num_workers,
                                          niceness=self.ray_cfg.worker_niceness)
        self._record_recipe()
        self.start_services()
        # the MLflow store opens (a new one migrates its schema) while the workers start; the run itself
        # is opened after they announce, because a resumed run's id comes from their checkpoint
        store = threading.Thread(target=self.tracker.prepare, args=(self.run_cfg.storage_path,),
                                 name="unirl-mlflow-prepare", daemon=True)
        store.start()
        announced = self.start_workers()
        self.startup.mark("services")
        store.join(timeout=120)
        state = announced.get("controller") or {}
        start_step = int(announced.get("restored_step", 0))
        if start_step and state.get("seed", self.run_cfg.seed) != self.run_cfg.seed:
            log.warning("resuming with trainer.seed=%s, but the run was started with seed %s: the "
                        "remaining steps will not match an uninterrupted run", self.run_cfg.seed, state["seed"])
        self.start_tracking(state.get("mlflow_run_id"), resumed=start_step > 0)
        self.startup.mark("tracking")
        self.restore(state)
        self._start_state = self.controller_state()  # what a restart before the first checkpoint rewinds to
        if start_step:
            console(f"resuming {self.run_cfg.run_name} after step {start_step}")
        return start_step

    def run_steps(self, start_step: int) -> dict[str, Any]:
        """Steps ``start_step + 1 .. num_steps``: the domain's ``run_step``, then log, save, report.

        If Ray Train restarts the worker group during a step (a worker died; ``ray.max_failures``
        allows it), the restarted workers load the last committed checkpoint and the controller
        rewinds to it (``recover``): the steps after it run again, in the same MLflow run.
        """
        cfg = self.run_cfg
        metrics: dict[str, Any] = {}
        step = start_step + 1
        while step <= cfg.num_steps:
            try:
                metrics = self.run_step(step)
                self.tracker.log_metrics({**metrics, **self._first_step_done()}, step=step)
                if step % cfg.checkpoint_every == 0 or step == cfg.num_steps:
                    self.save_checkpoint(step)
            except WorkerGroupRestarted as exc:
                step = self.recover(step, exc) + 1
                continue
            console(progress_line(step, cfg.num_steps, metrics))
            step += 1
        return metrics

    def commit_last(self, last: dict[str, Any]) -> dict[str, Any]:
        """Wait until the last checkpoint is on storage (a run counts as finished only then); returns the last
        step's metrics. A worker-group restart meanwhile (a worker, or its node, died after the last step)
        is recovered as one during a step: the restarted workers loaded the last committed checkpoint, and the
        steps after it run again before the next wait."""
        while True:
            try:
                self.group.wait_committed()
                return last
            except WorkerGroupRestarted as exc:
                restored = self.recover(self.run_cfg.num_steps, exc)
                if restored < self.run_cfg.num_steps:
                    last = self.run_steps(restored)

    def _first_step_done(self) -> dict[str, float]:
        """After the first step this process ran: the start-up milestones (printed; returned to be logged
        with the step's metrics); ``{}`` after any other."""
        clock = getattr(self, "startup", None)
        if clock is None or "first_step" in clock.marks:
            return {}
        clock.mark("first_step")
        console(clock.summary())
        return clock.metrics()

    def recover(self, step: int, cause: BaseException) -> int:
        """The worker group restarted during ``step``: wait for the new workers (restored from the last
        committed checkpoint), rewind the controller to that checkpoint; returns its step."""
        self.restarts = getattr(self, "restarts", 0) + 1
        console(f"step {step}: the train worker group restarted ({cause}); resuming from its last checkpoint "
                f"(restart {self.restarts} of at most ray.max_failures={self.ray_cfg.max_failures})")
        announced = self.group.wait_announced(self.ray_cfg.start_timeout_s)
        restored = int(announced.get("restored_step", 0))
        state = announced.get("controller") or self._start_state
        self.restore(state)
        self.after_restart(announced, restored)
        self.tracker.log_metrics({"fault/worker_group_restarts": float(self.restarts)}, step=restored)
        console(f"resumed after step {restored}; " + (f"steps {restored + 1}..{step} run again" if restored < step
                                                        else "its checkpoint holds every step done so far"))
        return restored

    def after_restart(self, announced: dict[str, Any], restored_step: int) -> None:
        """Domain state to rebuild after a worker-group restart (engines, streams, ...)."""

    @abstractmethod
    def run_step(self, step: int) -> dict[str, Any]:
        """One RL step in the domain's stage order; returns its metrics."""

    def start_services(self) -> None:
        """Deploy Serve apps (rewards, engines) before the workers start."""

    def driver_libraries(self) -> tuple[str, ...]:
        """The libraries (``runtime.imports.LIBRARIES``) this driver imports during ``setup()`` after Ray is up:
        loaded while an embedded Ray starts. Every trainer starts Ray Train workers; most track with MLflow."""
        return ("train", *(("mlflow",) if self.tracker.config.enabled else ()))

    def rank_sections(self, *, rollout: bool = True) -> dict[str, Any]:
        """What every train rank builds its rank object from: the ``worker_sections`` of the recipe (a
        trainer with named sides returns ``{"sides": {name: sections}}``); without the rollout when
        ``rollout`` is false (a dedicated engine rolls out, or an export that generates nothing)."""
        return {name: OmegaConf.to_container(self.recipe[name], resolve=True) for name in self.worker_sections
                if self.recipe.get(name) is not None and (rollout or name != "rollout")}

    def start_workers(self) -> dict[str, Any]:
        self.group = TrainGroup(
            sections=self.rank_sections(),
            ray_cfg=self.ray_cfg,
            run_name=self.run_cfg.run_name,
            storage_path=self.run_cfg.storage_path,
            seed=self.run_cfg.seed,
            datasets=self.worker_datasets(),
            rank_class=self.rank_class,
            broker_name=run_lock.lock_name(self.run_cfg.run_name) if self._run_lock is not None else None,
        )
        t0 = time.perf_counter()
        announced = self.group.start()
        if getattr(self, "startup", None) is not None:
            self.startup.mark("workers")
        log.info("%d train workers ready in %.1fs", self.group.world_size, time.perf_counter() - t0)
        return announced

    def worker_datasets(self) -> dict[str, Any] | None:
        """Ray Data datasets the train ranks read their shards of (``ray.train.get_dataset_shard``)."""
        return None

    def start_tracking(self, run_id: str | None, *, resumed: bool) -> None:
        run_root = self.run_cfg.storage_path
        tags = {"unirl.domain": self.domain, "unirl.demo_model": str(self.is_demo()).lower()}
        self.tracker.start(run_root, self.run_cfg.run_name, run_id=run_id, tags=tags)
        if not resumed:
            self.tracker.log_params(flatten(self.recipe))
            self.tracker.log_text(to_yaml(self.recipe), "recipe.yaml")
        if self.is_demo():
            log.warning("DEMO MODEL: no pretrained weights given, training a tiny randomly initialised model")

    def is_demo(self) -> bool:
        return False

    def restore(self, state: dict[str, Any]) -> None:
        """Restore the controller's own state (data cursor, ...) from a checkpoint."""

    def controller_state(self) -> dict[str, Any]:
        return {"mlflow_run_id": self.tracker.run_id, "seed": self.run_cfg.seed}

    def save_checkpoint(self, step: int) -> str | None:
        """Checkpoint the ranks and the controller at ``step``; the committed path (None while an asynchronous
        save is written: ``ray.async_checkpoint``). Logs ``timing/checkpoint`` (what training waited) and the
        save's phases (``checkpoint/write_s``: written, or copied to memory; ``report_s``: stored and
        committed; ``commit_wait_s``: the wait for the previous asynchronous save)."""
        t0 = time.perf_counter()
        result = self.group.save(step, self.controller_state())
        metrics = {"timing/checkpoint": time.perf_counter() - t0}
        metrics.update({f"checkpoint/{k}": float(result[k]) for k in ("write_s", "report_s", "commit_wait_s") if k in result})
        self.tracker.log_metrics(metrics, step=step)
        return result.get("path")

    # ----------------------------------------------------------------- export
    def export_at_end(self) -> None:
        """``trainer.export_dir``: export (and register) the final model while the workers are up."""
        cfg = self.run_cfg
        if cfg.export_dir is None:
            return
        from unirl_ray.train.export import is_previous_export

        self.export(
            cfg.export_dir,
            merge_lora=cfg.export_merge_lora,
            register_model_name=cfg.export_register_as,
            overwrite=is_previous_export(cfg.export_dir),
        )

    def export(
        self,
        directory: str,
        *,
        merge_lora: bool = True,
        register_model_name: str | None = None,
        overwrite: bool = False,
        side: str | None = None,
    ) -> str:
        """Write the trained model as a ``from_pretrained`` folder; returns its absolute path.

        While the workers are up (during ``fit``, e.g. via ``trainer.export_dir``, or between
        ``setup`` and ``teardown``) the live weights are exported. Afterwards (e.g. after ``fit``
        returned) the workers are started once more from the run's latest checkpoint, export, and
        stop. Train rank 0 writes the folder (see ``unirl_ray.train.export``): on a multi-node
        cluster use a shared path. With LoRA, ``merge_lora=False`` writes the base weights plus the
        adapter in PEFT format under ``lora_adapter/``. ``register_model_name`` logs the folder to
        the run's MLflow logged models and registers it as a new version of that registered model.
        ``side`` names the side to export where the ranks hold several (the prompt enhancer's ``ar`` and
        ``diffusion``).
        """
        from unirl_ray.train.export import check_export_dir, register_exported_model

        path = check_export_dir(directory, overwrite=overwrite)
        if register_model_name is not None:
            if not isinstance(register_model_name, str) or not register_model_name.strip():
                raise ValueError(f"register_model_name must be a non-empty string or None, got {register_model_name!r}")
            if not self.tracking_cfg.enabled:
                raise ValueError("register_model_name needs MLflow tracking: set tracking.enabled=true")
        payload = {"directory": path, "merge_lora": bool(merge_lora), "overwrite": bool(overwrite)}
        if side is not None:  # a trainer with named sides exports one side's model at a time
            payload["side"] = side
        t0 = time.perf_counter()
        if self._group_running():
            info, run_id = self.group.call("export", payload)[0], self.tracker.run_id
        else:
            info, run_id = self._export_from_checkpoint(payload)
        console(f"exported the trained model (policy version {info.policy_version}) to {path} "
                f"in {time.perf_counter() - t0:.1f}s; load it with from_pretrained({info.model_path!r})")
        if register_model_name is not None:
            if not run_id:
                raise ValueError(f"no MLflow run of {self.run_cfg.run_name!r} to register the model in")
            from unirl_ray.tracking.mlflow_tracker import resolve_tracking_uri

            uri = self.tracker.tracking_uri or resolve_tracking_uri(self.tracking_cfg, self.run_cfg.storage_path)
            registered = register_exported_model(path, name=register_model_name, tracking_uri=uri, run_id=run_id)
            console(f"registered {registered.uri} (logged model {registered.model_id} of run {run_id})")
        return path

    def _group_running(self) -> bool:
        thread = getattr(self.group, "_thread", None)
        return thread is not None and thread.is_alive()

    def _export_from_checkpoint(self, payload: dict[str, Any]) -> tuple[Any, str | None]:
        """Start the model-only workers from the latest checkpoint, export, stop them."""
        cfg = self.run_cfg
        run_dir = os.path.join(cfg.storage_path, cfg.run_name)
        no_checkpoint = (
            f"run {cfg.run_name!r} has no checkpoint under {cfg.storage_path} to export; train it first, "
            "or export while it runs (trainer.export_dir)"
        )
        if not is_uri(cfg.storage_path) and not self._has_checkpoint(run_dir):
            raise ValueError(no_checkpoint)
        console(f"export: starting the train workers from the latest checkpoint of {cfg.run_name}")
        ensure_ray(self.ray_cfg)
        group = TrainGroup(  # the model, not the rollout: exporting generates nothing
            sections=self.rank_sections(rollout=False), ray_cfg=self.ray_cfg, run_name=cfg.run_name, storage_path=cfg.storage_path, seed=cfg.seed,
            rank_class=self.rank_class,
        )
        try:
            announced = group.start()
            if not int(announced.get("restored_step", 0)):
                raise ValueError(no_checkpoint)
            info = group.call("export", payload)[0]
        finally:
            group.stop()
        return info, self.tracker.run_id or (announced.get("controller") or {}).get("mlflow_run_id")

    def teardown(self, status: str) -> None:
        """Stop the train workers and delete the Serve apps, then end the MLflow run.

        The workers' stop and the apps' deletion are independent and both mostly wait (on Ray Train
        ending its run, on Serve draining replicas), so they run at the same time (the stop is
        bounded by ``TrainGroup.stop``'s timeouts). The MLflow run is ended in any case (``FAILED``
        if either raised); the first error is raised after that.
        """
        errors: list[BaseException] = []

        def stop_group() -> None:
            try:
                self.group.stop()
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread below
                errors.append(exc)

        stopper = None
        if self.group is not None:
            stopper = threading.Thread(target=stop_group, name=f"stop-{self.domain}-workers", daemon=True)
            stopper.start()
        try:
            self.stop_services()
        except BaseException as exc:  # noqa: BLE001 - raised after the workers stopped and the run ended
            errors.insert(0, exc)
        if stopper is not None:
            stopper.join(timeout=300.0)  # TrainGroup.stop's own waits add up to ~3 min at most
            if stopper.is_alive():
                log.warning("the train workers did not stop within 300s; ending the run anyway")
        if self.tracker.run_id:
            final = status if not errors else "FAILED"
            self.tracker.end(final)
            print(
                f"MLflow run {self.tracker.run_id} ({final}) in {self.tracker.tracking_uri}\n"
                f"  open it with: {self.tracker.ui_command}",
                flush=True,
            )
        run_lock.release(self._run_lock)
        self._run_lock = None
        if errors:
            raise errors[0]

    def stop_services(self) -> None:
        """Delete the Serve apps this run deployed."""


def progress_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """One concise line per step for the driver's console."""
    def get(key: str) -> float:
        return float(metrics.get(key, float("nan")))

    def per_stage(key: str, fmt: str) -> str:
        """``metrics[key]``, else ``<stage> value`` for every ``<stage>/<key>`` (several sides or stages)."""
        if key in metrics or not any(k.endswith("/" + key) for k in metrics):
            return format(get(key), fmt)
        return " ".join(f"{k[: -len(key) - 1]} {format(float(v), fmt)}" for k, v in sorted(metrics.items())
                        if k.endswith("/" + key) and k.count("/") == key.count("/") + 1)

    return (
        f"step {step}/{total} | reward {get('reward/mean'):.4f} ± {get('reward/std'):.4f} | "
        f"loss {per_stage('train/loss', '.4g')} | clip {per_stage('algo/clip_frac', '.3f')} | "
        f"rollout {get('timing/rollout'):.2f}s reward {get('timing/reward'):.2f}s train {get('timing/train'):.2f}s | "
        f"{get('perf/samples_per_s'):.1f} samples/s"
    )


def _recipe_origin(flat: dict[str, str]) -> str:
    """``"an ar recipe with model /models/qwen"`` from a flattened recipe (its trainer target and model path)."""
    target = flat.get("trainer._target_", "")
    domain = target.rsplit(".", 2)[-2] if target.count(".") >= 2 else "another"
    paths = [v for k, v in flat.items() if k.startswith("bundle.") and k.endswith(("pretrained_model_path",
                                                                                      "pretrained_model_ckpt_path"))]
    model = next((p for p in paths if p not in ("null", "")), None)
    return f"{'an' if domain[:1] in 'aeiou' else 'a'} {domain} recipe with " + (f"model {model}" if model else "the tiny demo model")


def console(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
