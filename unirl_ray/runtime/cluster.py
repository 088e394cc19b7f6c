"""Joining or starting Ray, and the ``ray:`` block of a recipe."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Environment every process of a run gets: no hub downloads are attempted when a model is missing
# locally only if the user sets HF_HUB_OFFLINE themselves, so we pass through what the driver has.
_PASS_THROUGH_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "PRETRAINED_MODEL", "TOKENIZERS_PARALLELISM")


@dataclass(kw_only=True)
class RayConfig:
    """Where and on what the run executes (Ray's own option names inside ``scaling``)."""

    address: str | None = None
    """Cluster to join; None: ``RAY_ADDRESS`` / the job's cluster under ``ray job submit``, else a local Ray."""
    scaling: dict[str, Any] = field(default_factory=lambda: {"num_workers": 2, "resources_per_worker": {"CPU": 1}})
    """``ray.train.ScalingConfig`` arguments for the train workers."""
    max_failures: int = 0
    """Worker-group restarts Ray Train may do (from the latest checkpoint) before the run fails."""
    collective_timeout_s: int = 600
    """gloo / nccl timeout: a lost rank fails the step after this instead of hanging."""
    command_timeout_s: float = 1800.0
    """Longest the controller waits for one worker command (a rollout or a train step)."""
    start_timeout_s: float = 600.0
    """Longest the controller waits for the worker group to build its models and announce."""
    local_num_cpus: int | None = None
    """Logical CPUs of an embedded local Ray (default: max(8, cores), so small fractional tasks never starve)."""
    check_resources: bool = True
    """Fail fast when the cluster's total resources cannot hold the train workers (disable with an autoscaler)."""
    num_checkpoints_to_keep: int | None = 2
    """Committed checkpoints kept on storage (None: all)."""
    async_checkpoint: bool = True
    """Checkpoints do not block training: a save returns once every rank has written its shards to a local
    folder, and Ray Train uploads it to storage and commits it in the background
    (``checkpoint_upload_mode=ASYNC``). A restart or a resume only ever loads a committed checkpoint; the
    next save first waits for the previous one's commit (one in flight at most: a crash loses at most the
    steps since the checkpoint before the latest), and a run that ends waits for its last one. False:
    every save waits for its commit."""
    worker_niceness: int | None = 0
    """Scheduling priority of the train worker processes and of their command broker (every command
    between the driver and the workers passes through it). Ray starts worker processes at niceness 15,
    so on a busy machine every process at the default priority (Serve replicas, other jobs) takes the
    CPU from training first; 0 gives them the driver's priority. None keeps Ray's."""

    def __post_init__(self) -> None:
        workers = self.scaling.get("num_workers", 1)
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"ray.scaling.num_workers must be a positive integer, got {workers!r}")
        if self.max_failures < 0:
            raise ValueError(f"ray.max_failures must be >= 0, got {self.max_failures}")

    @property
    def num_workers(self) -> int:
        return int(self.scaling.get("num_workers", 1))

    @property
    def use_gpu(self) -> bool:
        return bool(self.scaling.get("use_gpu", False))

    def worker_resources(self) -> dict[str, float]:
        res = dict(self.scaling.get("resources_per_worker") or {})
        if self.use_gpu:
            res.setdefault("GPU", 1)
        res.setdefault("CPU", 1)
        return {k: float(v) for k, v in res.items()}


def set_niceness(target: int | None, what: str) -> None:
    """Move this process to niceness ``target`` (Ray starts its worker processes at 15); warn if not permitted."""
    if target is None:
        return
    try:
        current = os.nice(0)
        if current != target:
            os.nice(target - current)
    except (PermissionError, OSError) as exc:  # raising priority needs CAP_SYS_NICE
        log.warning("cannot set the %s's niceness to %s (%s); it keeps %s", what, target, exc, os.nice(0))


def runtime_env_vars() -> dict[str, str]:
    env = {k: os.environ[k] for k in _PASS_THROUGH_ENV if k in os.environ}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


EMBEDDED_RAY_ENV = {
    # one node that is never drained and has no dashboard to scrape it: no preemption-watcher actor per
    # Ray Train run and no Prometheus metrics of the Train controller and workers (seconds of CPU at start)
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    # the Train controller advances its run (workers started, a checkpoint committed, the run ended) once per
    # poll of its workers, every 2 s by default: a two-step one-worker fit on a warm Ray, 2 cores, took 8.3 s
    # at 0.5 s against 11.3 s at 2 s (0.1 s: 8.8 s; medians of 6, bench/warm_fit.py, 2026-12-06)
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}
"""What an embedded Ray (``ensure_ray`` without an address) runs with, unless the environment says otherwise;
the processes of the Ray it starts inherit it."""


def ensure_ray(cfg: RayConfig) -> str:
    """Connect to the configured cluster or start an embedded one; returns a description."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return "existing Ray session"
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        # Keep the job's own runtime_env (e.g. `ray job submit --working-dir .`) untouched; the
        # train workers get their env vars through RunConfig.worker_runtime_env.
        ray.init(address=address, log_to_driver=True)
        return f"Ray cluster at {address}"
    num_cpus = cfg.local_num_cpus or max(8, os.cpu_count() or 1)
    for key, value in EMBEDDED_RAY_ENV.items():
        os.environ.setdefault(key, value)
    env = {"env_vars": runtime_env_vars()}
    ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)
    return f"embedded local Ray ({num_cpus} logical CPUs)"


def check_cluster_fits(cfg: RayConfig, extra: dict[str, float] | None = None) -> None:
    """Raise ValueError naming what is missing when the cluster can never hold the run."""
    import ray

    if not cfg.check_resources:
        return
    need: dict[str, float] = {}
    for key, value in cfg.worker_resources().items():
        need[key] = need.get(key, 0.0) + value * cfg.num_workers
    for key, value in (extra or {}).items():
        need[key] = need.get(key, 0.0) + value
    have = ray.cluster_resources()
    missing = {k: (v, have.get(k, 0.0)) for k, v in need.items() if have.get(k, 0.0) + 1e-9 < v}
    if missing:
        detail = ", ".join(f"{k}: need {v:g}, cluster has {h:g}" for k, (v, h) in missing.items())
        raise ValueError(
            f"the Ray cluster cannot hold this run ({detail}). Lower ray.scaling (num_workers, "
            "resources_per_worker) or the reward replicas' ray_actor_options, or add nodes; set "
            "ray.check_resources=false if an autoscaler will add them."
        )
