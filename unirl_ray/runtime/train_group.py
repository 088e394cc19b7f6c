"""``TrainGroup``: the controller's handle on the long-lived Ray Train run.

``TorchTrainer.fit()`` runs in a daemon thread of the driver for the whole job; its workers execute
``runtime.worker.worker_main``. The controller talks to them only through the ``CommandBroker``:
``call(op, payloads)`` queues one command per rank and waits for every rank's answer, polling in
short slices so that a dead ``fit()`` or a missed deadline surfaces as an exception, never a hang.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from typing import Any

import ray

from unirl_ray.runtime.broker import CommandBroker, pack, unpack
from unirl_ray.runtime.cluster import RayConfig, on_driver_node, worker_env_vars
from unirl_ray.runtime.imports import import_ray_library

log = logging.getLogger(__name__)

NAMESPACE = "unirl_ray"


class WorkerError(RuntimeError):
    """A train worker raised while executing a command (the message carries its traceback)."""


class WorkerGroupRestarted(RuntimeError):
    """The worker group restarted while a command was in flight (results were fenced)."""


class TrainGroup:
    """Start, command and stop the train workers of one run."""

    def __init__(
        self,
        *,
        sections: dict[str, Any],
        ray_cfg: RayConfig,
        run_name: str,
        storage_path: str,
        seed: int,
        datasets: dict[str, Any] | None = None,
        rank_class: str | None = None,
        broker_name: str | None = None,
    ) -> None:
        """``rank_class``: dotted path of what each rank builds from ``sections`` (default
        ``runtime.worker.DEFAULT_RANK_CLASS``, the single-stack ``train.rank.StackWorker``). ``broker_name``: a
        fresh ``CommandBroker`` for ``ray_cfg.num_workers`` ranks that the caller owns (the run's lock,
        ``runtime.run_lock``); without one the group starts its own and kills it when it stops."""
        self.ray_cfg = ray_cfg
        self.datasets = datasets  # Ray Data datasets for the ranks (ray.train.get_dataset_shard; see _dataset_config)
        self.run_name = run_name
        self.storage_path = storage_path
        self.world_size = ray_cfg.num_workers
        self._own_broker = broker_name is None
        if broker_name is None:
            self.broker_name = f"unirl-broker-{run_name}-{uuid.uuid4().hex[:8]}"
            self.broker = CommandBroker.options(name=self.broker_name, namespace=NAMESPACE, **on_driver_node()).remote(
                self.world_size, niceness=ray_cfg.worker_niceness)
        else:
            self.broker_name, self.broker = broker_name, ray.get_actor(broker_name, namespace=NAMESPACE)
        self.loop_config = {
            "sections": sections,
            "rank_class": rank_class,
            "broker_name": self.broker_name,
            "namespace": NAMESPACE,
            "use_gpu": ray_cfg.use_gpu,
            "seed": seed,
            "log_level": logging.getLevelName(logging.getLogger().level),
            "worker_niceness": ray_cfg.worker_niceness,
            "has_datasets": bool(datasets),
            "save_timeout_s": ray_cfg.command_timeout_s,  # the longest a save waits for the previous one's write
        }
        self._thread: threading.Thread | None = None
        self._fit_error: BaseException | None = None
        self._fit_result: Any = None
        self._ready = False  # every rank announced (since the last start or restart)
        self._uncommitted: str | None = None  # the asynchronous checkpoint still being written, by name

    # ---------------------------------------------------------------- start
    def _trainer(self):
        from ray.train import FailureConfig, RunConfig, ScalingConfig

        from unirl_ray.runtime.process_group import ProcessGroupConfig
        from unirl_ray.runtime.worker import worker_main

        cfg = self.ray_cfg
        scaling = dict(cfg.scaling)
        scaling["resources_per_worker"] = cfg.worker_resources()
        return _torch_trainer_class(with_datasets=bool(self.datasets))(
            worker_main,
            train_loop_config=self.loop_config,
            datasets=self.datasets,
            dataset_config=self._dataset_config(),
            # TorchConfig's work without its module, which imports torch into the controller on every start
            torch_config=ProcessGroupConfig(backend="nccl" if cfg.use_gpu else "gloo", timeout_s=cfg.collective_timeout_s),
            scaling_config=ScalingConfig(**scaling),
            run_config=RunConfig(
                name=self.run_name,
                storage_path=self.storage_path,
                failure_config=FailureConfig(max_failures=cfg.max_failures, controller_failure_limit=0),
                worker_runtime_env=_worker_runtime_env(),
            ),
        )

    def _dataset_config(self):
        """Dataset ``"train"`` is split over the ranks (``streaming_split(equal=True)``); any other one (held-out
        data) reaches every rank whole. Ray Train's defaults plus ``preserve_order``: every epoch then gives
        each rank the same records in the same order (blocks are assigned as they arrive), so a data cursor
        resumes exactly."""
        if not self.datasets:
            return None
        from ray.train import DataConfig

        options = DataConfig.default_ingest_options()
        options.preserve_order = True
        return DataConfig(datasets_to_split=["train"], execution_options=options)

    def _fit(self) -> None:
        try:
            import_ray_library(*(("train", "data") if self.datasets else ("train",)))
            self._fit_result = self._trainer().fit()
        except BaseException as exc:  # surfaced to the controller by _check_alive
            self._fit_error = exc

    def start(self) -> dict[str, Any]:
        """Launch ``fit()`` and wait for every rank to announce; returns rank 0's announcement."""
        self._thread = threading.Thread(target=self._fit, name=f"fit-{self.run_name}", daemon=True)
        self._thread.start()
        return self.wait_announced(self.ray_cfg.start_timeout_s)

    def wait_announced(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            infos = ray.get(self.broker.announcements.remote(), timeout=30)
            errors = [f"rank {r}: {i['error']}\n{i.get('traceback', '')}" for r, i in infos.items() if "error" in i]
            if errors:
                raise WorkerError("train workers failed to build their models:\n" + "\n".join(errors))
            if len(infos) == self.world_size:
                ray.get(self.broker.clear_announcements.remote(), timeout=30)
                self._ready = True
                return infos[0]
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(infos)}/{self.world_size} train workers started within {timeout_s:.0f}s "
                    f"(each needs {self.ray_cfg.worker_resources()}); check `ray status` for free resources"
                )
            time.sleep(0.2)

    def _check_alive(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            raise WorkerError(f"the Ray Train run ended unexpectedly: {self._fit_error or self._fit_result!r}")

    # --------------------------------------------------------------- commands
    def call(self, op: str, payloads: list[Any] | Any, *, timeout_s: float | None = None) -> list[Any]:
        """Run ``op`` on every rank (a list gives each rank its own payload); returns per-rank results."""
        if not isinstance(payloads, list):
            payloads = [payloads] * self.world_size
        boxes = [pack(p) for p in payloads]
        deadline = time.monotonic() + (timeout_s or self.ray_cfg.command_timeout_s)
        cmd_id, results = ray.get(self.broker.submit_and_collect.remote(op, boxes, 1.0), timeout=60)
        while True:
            if results is not None:
                return self._unwrap(op, results)
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"train workers did not finish {op!r} within {timeout_s or self.ray_cfg.command_timeout_s:.0f}s")
            results = ray.get(self.broker.collect.remote(cmd_id, 1.0), timeout=60)

    def _unwrap(self, op: str, results: list[Any]) -> list[Any]:
        if any(isinstance(r, dict) and r.get("fenced") for r in results):
            self._uncommitted = None  # the new workers loaded the last committed checkpoint, whatever it was
            raise WorkerGroupRestarted(f"the worker group restarted during {op!r}")
        errors = [f"rank {i}: {r['error']}\n{r.get('traceback', '')}" for i, r in enumerate(results) if "error" in r]
        if errors:
            raise WorkerError(f"train workers failed on {op!r}:\n" + "\n".join(errors))
        return [unpack(r) for r in results]

    def save(self, step: int, controller_state: dict[str, Any]) -> dict[str, Any]:
        """Collective checkpoint; rank 0's report: ``path`` (the committed checkpoint; None while an
        asynchronous save is still written), ``write_s`` / ``report_s`` / ``commit_wait_s`` (its phases:
        the shards written, or for an asynchronous save copied to memory; stored and committed; the wait
        for the previous asynchronous save).

        A checkpoint is committed once every rank's shards are in the run's storage and rank 0 has marked
        the folder (``runtime.worker._save``): a restart or a resume only loads committed ones. With
        ``ray.async_checkpoint`` the ranks return once their shards are copied to memory and a thread per
        rank writes, stores and commits them; ``wait_committed`` waits for it (``stop`` does, a finished run
        does before it ends, and the next save does first: at most one checkpoint is uncommitted at any
        time)."""
        asynchronous = self.ray_cfg.async_checkpoint
        payload = {"step": step, "controller": controller_state, "asynchronous": asynchronous,
                   "keep": self.ray_cfg.num_checkpoints_to_keep}
        result = self.call("save", payload)[0]
        self._uncommitted = result["name"] if asynchronous and result["path"] is None else None
        return result

    def wait_committed(self, timeout_s: float | None = None) -> str | None:
        """Block until the last asynchronous checkpoint is committed; its path (None if none is pending)."""
        name, self._uncommitted = self._uncommitted, None
        if name is None:
            return None
        timeout_s = timeout_s or self.ray_cfg.command_timeout_s
        return self.call("wait_checkpoint", {"name": name, "timeout_s": timeout_s}, timeout_s=timeout_s + 60)[0]["path"]

    def stop(self, timeout_s: float = 60.0) -> None:
        """Clean shutdown: ask the workers to return, then let ``fit()`` finish.

        A group that never finished starting (a start that timed out or failed) is closed instead:
        ranks still starting return as soon as they reach the broker, before building their models.
        """
        if self._thread is None or not self._thread.is_alive():
            return
        if self._ready and self._uncommitted is not None:  # a failing run keeps the steps it checkpointed
            pending = self._uncommitted
            try:
                self.wait_committed()
            except Exception as exc:  # noqa: BLE001 - the group may be gone; stop anyway
                log.warning("the checkpoint %s may not have been committed: %s", pending, exc)
        try:
            if self._ready:
                cmd_id = ray.get(self.broker.submit.remote("stop", [None] * self.world_size), timeout=30)
                ray.get(self.broker.collect.remote(cmd_id, timeout_s), timeout=timeout_s + 30)
        except Exception as exc:  # the group may already be gone
            log.warning("stopping train workers: %s", exc)
        try:  # ranks that did not take the stop (still starting, or restarting) get it from the closed broker
            ray.get(self.broker.close.remote(), timeout=30)
        except Exception as exc:  # noqa: BLE001 - the broker may already be gone
            log.warning("closing the command broker: %s", exc)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.warning("the Ray Train run did not end within %.0fs after stop", timeout_s)
        if self._own_broker:
            ray.kill(self.broker)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_path, self.run_name)


_STATE_API: dict[str, bool] = {}


def state_api_available() -> bool:
    """Whether the connected cluster answers Ray's State API (its dashboard runs; not in the embedded
    local Ray, which starts without one). Asked once per cluster."""
    gcs = ray.get_runtime_context().gcs_address
    if gcs not in _STATE_API:
        from ray.util.state import list_nodes

        try:
            list_nodes(limit=1, timeout=5, raise_on_missing_output=False)
            _STATE_API[gcs] = True
        except Exception:  # noqa: BLE001 - no dashboard (ServerUnavailable), or one that does not answer
            _STATE_API[gcs] = False
    return _STATE_API[gcs]


@functools.cache
def _torch_trainer_class(*, with_datasets: bool = True) -> type:
    """``TorchTrainer`` without the per-run actors that can never act here (one class per process and
    variant, built on first use, so importing this module does not import Ray Train):

    - Ray Train's ``PlacementGroupCleaner`` where the cluster has no State API: a detached actor per run
      that asks the State API every second whether the controller is still alive, to free the workers'
      placement group if it died. Without a dashboard every one of those questions fails: it can never act,
      logs a warning each second, and costs each run one more actor process.
    - its ``DatasetManager`` when the run passes no datasets (``with_datasets=False``): an actor process per
      run that imports Ray Data to split nothing (~3 CPU-seconds at every start on a 2-core machine). The
      workers then have no dataset shard provider, and ``runtime.worker`` opens no shards.

    and, where every process of the Ray inherited the variables Ray Train would give its controller as a
    runtime env (the embedded local Ray, ``cluster.start_local_ray``), a controller and workers without a
    runtime env of their own (``runtime.train_controller``: no setup process per actor, idle workers taken);
    the autoscaling coordinator the controller waits for before it asks for its workers (a detached actor, one
    per cluster) is then created by the driver as the controller starts, beside it instead of after it.
    """
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:  # another Ray Train layout: keep its defaults
        return TorchTrainer

    class Trainer(TorchTrainer):
        def _create_default_callbacks(self):
            drop = () if state_api_available() else (PlacementGroupCleanerCallback,)
            if not with_datasets:
                drop += (DatasetsCallback,)
            return [c for c in super()._create_default_callbacks() if not isinstance(c, drop)]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            if not _controller_env_inherited():
                return super()._initialize_and_run_controller(**controller_init_kwargs)
            from ray._raylet import RAY_NODE_ID_KEY

            from unirl_ray.runtime.train_controller import InheritedEnvController

            _start_autoscaling_coordinator()
            # as Ray Train starts its controller (on the driver's node, no CPU), without the runtime env
            here = {RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}
            controller = ray.remote(num_cpus=0, label_selector=here)(InheritedEnvController).remote(
                **controller_init_kwargs)
            ray.get(controller.run.remote())
            return ray.get(controller.get_result.remote())

    return Trainer


def _controller_env_inherited() -> bool:
    """Whether every variable Ray Train would give its controller as a runtime env (those of the driver's it
    propagates, ``RAY_TRAIN_*`` and a few others; ``RAY_WARN_BLOCKING_GET_INSIDE_ASYNC``) is one the processes of
    this Ray inherited, with the same value (``cluster.inherited_env_vars``: a local Ray this process started);
    False where Ray Train's layout is not the one known here."""
    from unirl_ray.runtime.cluster import inherited_env_vars

    try:
        from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR as WARN
        from ray.train.v2._internal.constants import DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE as QUIET
        from ray.train.v2._internal.constants import get_env_vars_to_propagate
        from ray.train.v2._internal.execution.controller.controller import TrainController
    except ImportError:
        return False
    if getattr(TrainController, "worker_group_cls", None) is None:
        return False
    inherited = inherited_env_vars()
    wanted = get_env_vars_to_propagate()
    wanted.setdefault(WARN, QUIET)
    return bool(inherited) and all(inherited.get(key) == value for key, value in wanted.items())


def _start_autoscaling_coordinator() -> None:
    """Create Ray's autoscaling coordinator (a detached actor, one per cluster, that Ray Train's controller
    registers its resource request with, waiting for it, before it starts the workers) unless it exists."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
    except ImportError:  # another layout: the controller creates it, as it always does
        return
    get_or_create_autoscaling_coordinator()


def _worker_runtime_env() -> dict[str, Any] | None:
    """The train workers' runtime env: the variables passed through from the driver (``runtime_env_vars``)
    that the Ray's processes did not all inherit at its start (``cluster.start_local_ray``); None when they
    did, so the workers start without a runtime env of their own (quicker: no setup process)."""
    missing = worker_env_vars()
    return {"env_vars": missing} if missing else None
