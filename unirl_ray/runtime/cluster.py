"""Joining or starting Ray, and the ``ray:`` block of a recipe."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
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
    """Cluster to join; None: ``RAY_ADDRESS`` / the job's cluster under ``ray job submit``, else a new local Ray
    (also where ``ray start`` runs a cluster on this machine: ``auto`` joins that one)."""
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
    connect_timeout_s: float = 60.0
    """Longest the driver tries to reach the cluster it joins (``address`` / ``RAY_ADDRESS``) before it fails
    with an error naming it (``ray.init`` itself would retry an unreachable cluster forever)."""
    local_num_cpus: int | None = None
    """Logical CPUs of an embedded local Ray (default: max(8, cores), so small fractional tasks never starve)."""
    check_resources: bool = True
    """Fail fast when the cluster's total resources cannot hold the train workers (disable with an autoscaler)."""
    num_checkpoints_to_keep: int | None = 2
    """Committed checkpoints kept on storage, the newest (None: all); older ones are deleted after each commit."""
    async_checkpoint: bool = True
    """Checkpoints do not block training: a save returns once every rank has copied its shards to memory
    (staged as DCP's ``async_save`` stages them); a thread per rank writes them into the run's storage
    (``<storage_path>/<run_name>/checkpoint_<step>/``, a folder or a URI) and, once every rank's are there,
    rank 0 marks the folder committed. A restart or a resume only ever loads a committed checkpoint; the
    next save first waits for the previous one's commit (one in flight at most: a crash loses at most the
    steps since the checkpoint before the latest), and a run that ends waits for its last one. False:
    every save is written, stored and committed before training goes on."""
    runtime_env: dict[str, Any] | None = None
    """Ray's runtime environment for the whole run (``working_dir``, ``py_modules``, ``pip`` / ``uv``,
    ``env_vars``, ...): set on the job when the trainer starts or joins Ray, so every train worker, Serve
    replica (reward and engine apps) and Ray Data task runs in it, e.g. with your own reward module
    (``py_modules: [./my_rewards]``). Local ``py_modules`` / ``working_dir`` paths are importable on the driver
    too. Under ``ray job submit --runtime-env-json`` the two are merged (Ray refuses the same field or
    variable set twice). A Ray already started in this process (a notebook's ``ray.init()``) must carry it:
    ``ray.init(runtime_env=...)``, or leave Ray to the trainer."""
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
        if not self.connect_timeout_s > 0:
            raise ValueError(f"ray.connect_timeout_s must be > 0 seconds, got {self.connect_timeout_s!r}")
        check_runtime_env(self.runtime_env)

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


_RUNTIME_ENV_FIELDS = ("working_dir", "py_modules", "py_executable", "pip", "uv", "conda", "container", "image_uri",
                       "env_vars", "excludes", "config", "worker_process_setup_hook", "java_jars", "nsight")


def check_runtime_env(env: Any) -> None:
    """``ray.runtime_env`` is a mapping of Ray's runtime-env fields; ``env_vars`` maps names to strings."""
    if env is None:
        return
    if not isinstance(env, Mapping):
        raise ValueError(f"ray.runtime_env must be a mapping of Ray runtime_env fields, got {env!r}")
    unknown = sorted(k for k in env if k not in _RUNTIME_ENV_FIELDS)
    if unknown:
        raise ValueError(f"ray.runtime_env has unknown field(s) {unknown}; Ray's fields are {list(_RUNTIME_ENV_FIELDS)}")
    env_vars = env.get("env_vars") or {}
    if not isinstance(env_vars, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()):
        raise ValueError(f"ray.runtime_env.env_vars must map names to strings (quote numbers: '1'), got {env_vars!r}")
    for key in ("py_modules",):
        if key in env and (isinstance(env[key], str) or not isinstance(env[key], (list, tuple))):
            raise ValueError(f"ray.runtime_env.{key} must be a list of paths or URIs, got {env[key]!r}")


def _is_local(path: Any) -> bool:
    return isinstance(path, str) and "://" not in path and os.path.exists(os.path.expanduser(path))


def add_driver_import_paths(env: Any) -> list[str]:
    """Make the local ``py_modules`` (a package folder or a ``.py`` file: its parent) and ``working_dir`` of a
    recipe's ``ray.runtime_env`` importable on the driver, as they will be on the workers; returns the paths
    added to ``sys.path`` (URIs and paths that do not exist are left to Ray)."""
    import sys

    if not isinstance(env, Mapping):
        return []
    paths = [os.path.dirname(os.path.abspath(os.path.expanduser(str(m).rstrip("/"))))
             for m in env.get("py_modules") or [] if _is_local(m)]
    if _is_local(env.get("working_dir")):
        paths.append(os.path.abspath(os.path.expanduser(env["working_dir"])))
    added = [p for p in dict.fromkeys(paths) if p not in sys.path]
    sys.path[:0] = added
    return added


def job_runtime_env(cfg: RayConfig) -> dict[str, Any]:
    """What an embedded Ray starts with: the recipe's ``runtime_env`` plus the variables passed through from
    this process (``HF_HUB_OFFLINE``, ...; the recipe's own ``env_vars`` win)."""
    env = dict(cfg.runtime_env or {})
    env["env_vars"] = {**runtime_env_vars(), **(env.get("env_vars") or {})}
    return env


def _session_lacks(wanted: Mapping[str, Any] | None, session: Mapping[str, Any]) -> list[str]:
    """Fields / variables of ``wanted`` the running session's runtime env does not have."""
    if not wanted:
        return []
    missing = [k for k in wanted if k != "env_vars" and k not in session]
    have = session.get("env_vars") or {}
    missing += [f"env_vars.{k}" for k, v in (wanted.get("env_vars") or {}).items() if have.get(k) != v]
    return missing


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
    # Ray's log monitor globs the session's log folder for new worker logs on every 0.1 s pass while it has
    # fewer than this many files; at 0 it looks every 0.5 s (a new worker's first lines reach the driver up to
    # 0.5 s later, none is lost). With the ~330 log files of 150 actors started and gone, it used 3.7% of a
    # core while idle, 1.6% at 0 (30 s each, 2 cores, 2026-12-06); ~17 CPU-s of the shared-Ray test lane
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    # what Ray Train sets for its controller (it blocks on Ray calls inside its async methods by design); here
    # every process inherits it, so the controller and its workers need no runtime env (runtime.train_controller).
    # It also silences Ray's warning about a blocking ray.get in an async method in the other processes of this Ray
    # (Serve replicas, this project's actors): a development aid, not a check
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
}
"""What an embedded Ray (``ensure_ray`` without an address) runs with, unless the environment says otherwise;
the processes of the Ray it starts inherit it."""


_NOT_INHERITED = ("RAY_", "CUDA_", "HIP_", "ROCR_")
"""Variables an embedded Ray's daemons must not inherit (Ray's own settings, accelerator visibility, which
``ray.init`` reads to count GPUs): a recipe that sets one passes its variables as a runtime env instead."""
_inherited: tuple[str, dict[str, str]] | None = None
"""``(node id, environment)`` of the local Ray ``start_local_ray`` started: its daemons' environment (the driver's at
the start, with the variables given), which every process of it inherits."""


def start_local_ray(num_cpus: int, env_vars: Mapping[str, str], **init_kwargs: Any) -> None:
    """Start a new local Ray (``ray.init(address="local")``) whose daemons, and so every worker process,
    inherit ``env_vars``, instead of a runtime env that carries them: a worker with a runtime env of its own
    is started through Ray's setup process (a second interpreter) and cannot reuse the idle workers Ray
    starts ahead (an actor's start: 0.7-0.9 s against 0.1-0.5 s on 2 cores). The variables are in this
    process's environment only while ``ray.init`` starts the daemons."""
    import ray

    global _inherited
    saved = {k: os.environ.get(k) for k in env_vars}
    os.environ.update(env_vars)
    environment = dict(os.environ)  # what the daemons start with, and pass on to every process they start
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **init_kwargs)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        _inherited = (ray.get_runtime_context().get_node_id(), environment)
    except RuntimeError:  # no node to tie them to (ray.init did not connect): nothing counts as inherited
        _inherited = None


def inherited_env_vars() -> dict[str, str]:
    """The variables every process of the running Ray inherited from its start (``start_local_ray`` in this
    process), else ``{}``."""
    import ray

    if _inherited is None or not ray.is_initialized():
        return {}
    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - a driver without a node of its own: nothing is known to be inherited
        return {}
    return dict(_inherited[1]) if node == _inherited[0] else {}


def worker_env_vars() -> dict[str, str] | None:
    """``runtime_env_vars()`` less what every process of this Ray already inherited (None when nothing is
    left: the processes then start without a runtime env of their own)."""
    inherited = inherited_env_vars()
    missing = {k: v for k, v in runtime_env_vars().items() if inherited.get(k) != v}
    return missing or None


def dialled_address(address: str) -> tuple[str, int] | None:
    """The host and port ``ray.init(address)`` connects to first: the GCS (``host:port``, ``auto``: the cluster
    ``ray start`` runs on this machine, or ``RAY_ADDRESS`` where it is set, as ``ray.init`` reads it; a loopback
    host becomes this node's IP, as Ray resolves it) or a Ray Client server (``ray://host[:10001]``); None for
    ``local`` (a new Ray) and other client schemes (left to ``ray.init``)."""
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if "://" in address and not address.startswith("ray://"):
        return None
    if address.startswith("ray://"):
        netloc = address[len("ray://"):].split("/", 1)[0]
        host, sep, port = netloc.rpartition(":")
        return (host.strip("[]"), int(port)) if sep and port.isdigit() else (netloc.strip("[]"), 10001)
    from ray._private.services import canonicalize_bootstrap_address

    canonical = canonicalize_bootstrap_address(address)  # auto with no cluster on this machine: ConnectionError
    if canonical is None:
        return None
    host, _, port = canonical.rpartition(":")
    return host.strip("[]"), int(port)


def wait_for_cluster(address: str, timeout_s: float) -> None:
    """Return once the cluster's first port answers (a TCP connect); ConnectionError naming it after
    ``timeout_s`` (a cluster still starting gets that long). ``ray.init`` retries an unreachable GCS forever,
    logging a warning every few seconds: a notebook cell or a submitted job would hang with it."""
    import socket
    import time

    target = dialled_address(address)
    if target is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(target, timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConnectionError(
                    f"cannot reach the Ray cluster at {address!r} ({target[0]}:{target[1]}) within {timeout_s:g}s: "
                    f"{exc}. Check that it runs (`ray status --address {target[0]}:{target[1]}` on its head) and that "
                    "this machine can reach that port; or unset ray.address and RAY_ADDRESS to start a local Ray "
                    "(ray.connect_timeout_s sets how long to try)") from exc
            time.sleep(min(1.0, left))


def ensure_ray(cfg: RayConfig, prefetch: tuple[str, ...] = ()) -> str:
    """Connect to the configured cluster or start an embedded one; returns a description.

    ``prefetch``: libraries (``runtime.imports.LIBRARIES``) the driver needs next, imported in a thread
    while an embedded Ray's daemons start (the driver waits ~3 s for them on 2 cores, idle). What
    ``ray.init`` itself imports on first use is imported here before, so that the two threads never
    import the same modules; the thread is joined before this returns."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        session = dict(ray.get_runtime_context().runtime_env or {})
        session["env_vars"] = {**inherited_env_vars(), **(session.get("env_vars") or {})}
        lacks = _session_lacks(cfg.runtime_env, session)
        if lacks:
            raise ValueError(f"Ray is already running in this process without ray.runtime_env's {lacks}: its train "
                             "workers, Serve replicas and Ray Data tasks would run without them. Start Ray with "
                             "ray.init(runtime_env=<the recipe's ray.runtime_env>), or call ray.shutdown() and let "
                             "the trainer start it")
        return "existing Ray session"
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        wait_for_cluster(address, cfg.connect_timeout_s)
        # A job's own runtime_env (e.g. `ray job submit --working-dir .`) is merged by Ray with the recipe's; the
        # train workers get the variables passed through from here in RunConfig.worker_runtime_env.
        ray.init(address=address, log_to_driver=True, runtime_env=cfg.runtime_env or None)
        return f"Ray cluster at {address}"
    num_cpus = cfg.local_num_cpus or max(8, os.cpu_count() or 1)
    for key, value in EMBEDDED_RAY_ENV.items():
        os.environ.setdefault(key, value)
    # address="local": a new Ray of this process's own, even where `ray start` left a cluster on this machine
    # (plain ray.init() would join that one, and refuses num_cpus there); ray.address=auto joins it instead
    loading = None
    if prefetch:
        from unirl_ray.runtime.imports import import_ray_library
        from unirl_ray.runtime.imports import prefetch as prefetch_imports

        import_ray_library("init")
        loading = prefetch_imports(*prefetch)
    env = job_runtime_env(cfg)
    variables = env.get("env_vars") or {}
    if set(env) <= {"env_vars"} and not any(k.startswith(_NOT_INHERITED) or k.endswith("_VISIBLE_DEVICES")
                                           for k in variables):
        start_local_ray(num_cpus, variables, log_to_driver=True)  # no runtime env: workers start quicker
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=env, log_to_driver=True)
    if loading is not None:  # the driver's next imports and threads start once these are loaded
        loading.join(timeout=120)
    return f"embedded local Ray ({num_cpus} logical CPUs)"


def on_driver_node() -> dict[str, Any]:
    """Actor options that pin an actor to the node of this (driver) process: a run's own control actors (the
    command broker that is also its lock, the weight store, the version gate) hold no resources, so Ray may
    otherwise place them on any node, and a worker node that dies (or is scaled down) would take the run with
    it. The driver's node lives as long as the run does."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - a driver without a node of its own (Ray Client): Ray places them
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


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
