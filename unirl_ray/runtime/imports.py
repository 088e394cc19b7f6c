"""Ray's libraries imported one thread at a time.

The driver overlaps its start-up work in threads: the Ray Train run's ``fit()`` (which imports Ray Train
on first use), the prompt prefetch and the rollout stream (whose first dataset execution imports Ray
Data's executor). Those two import trees share packages (Ray Train's scaling policy imports
``ray.data._internal.cluster_autoscaler``, as does Ray Data's streaming executor), and Python's
per-module import locks, taken in different orders by two threads, end one of the imports with
``_DeadlockError`` (seen in CI: a notebook's first ``fit()`` died with "deadlock detected by
_ModuleLock('ray.data._internal.cluster_autoscaler')").

So each driver entry point into a Ray library (``TrainGroup._fit``, the prompt and record readers, the
rollout stream) calls ``import_ray_library(...)`` first: the imports run
under one process-wide lock, one thread at a time, and are free once done. The work after them still
overlaps; only the imports (which hold the GIL most of the time anyway) are serialised.
"""

from __future__ import annotations

import importlib
import sys
import threading

# What each library imports lazily on first use, measured on Ray 2.60: TorchTrainer and its callbacks
# (and, through them, the scaling policy and Ray Data's autoscaler); a dataset's first execution (the
# planner, the optimizer rules and the streaming executor with its autoscaler).
LIBRARIES: dict[str, tuple[str, ...]] = {
    # what ``ray.init`` of a local Ray imports on first use (usage stats, the autoscaler's config helpers, the
    # dashboard's optional dependencies: aiohttp, grpc, opencensus, prometheus_client, pydantic)
    "init": (
        "ray._common.usage.usage_lib",
        "ray._private.runtime_env.uv_runtime_env_hook",
        "ray._private.thirdparty.pynvml",
        "ray.autoscaler._private.util",
        "ray.autoscaler._private.loader",
        "ray.autoscaler._private.docker",
        "ray.autoscaler._private.local.config",
        "ray.autoscaler.v2.utils",
        "ray.autoscaler.v2.instance_manager.common",
        "ray.dashboard.optional_deps",
    ),
    # the tracker's client and its SQLite store (SQLAlchemy, Alembic's migrations)
    "mlflow": (
        "mlflow",
        "mlflow.tracking",
        "mlflow.store.tracking.sqlalchemy_store",
    ),
    "serve": ("ray.serve",),
    "train": (
        "ray.train",
        "ray.train.torch",
        "ray.train.v2._internal.callbacks.datasets",
        "ray.train.v2._internal.callbacks.placement_group_callback",
        "ray.train.v2._internal.execution.scaling_policy",
    ),
    "data": (
        "ray.data",
        "ray.data._internal.cluster_autoscaler",
        "ray.data._internal.execution.streaming_executor",
        "ray.data._internal.planner.planner",
        "ray.data._internal.logical.optimizers",
    ),
}

_LOCK = threading.Lock()
_DONE: set[str] = set()  # libraries imported (or skipped) in this process: later calls return at once


def import_ray_library(*names: str) -> None:
    """Import the modules of each named library (keys of ``LIBRARIES``) under the process-wide import lock.

    A private module (``._internal``) missing from another Ray layout is skipped; a public one raises.
    """
    unknown = [n for n in names if n not in LIBRARIES]
    if unknown:
        raise ValueError(f"unknown Ray library {unknown}; known: {sorted(LIBRARIES)}")
    if _DONE.issuperset(names):
        return
    with _LOCK:
        for name in names:
            for module in LIBRARIES[name]:
                if module in sys.modules:
                    continue
                try:
                    importlib.import_module(module)
                except ImportError:
                    if "._internal" not in module and name != "init":  # ray.init's own: all optional
                        raise
            _DONE.add(name)


def prefetch(*names: str) -> threading.Thread | None:
    """Import the libraries ``names`` (keys of ``LIBRARIES``) in a daemon thread, under the same lock as
    ``import_ray_library``; the thread to join, or None when all are imported already. A failure is only
    logged: whoever needs the library imports it again and sees the error there."""
    import logging

    unknown = [n for n in names if n not in LIBRARIES]
    if unknown:
        raise ValueError(f"unknown library {unknown}; known: {sorted(LIBRARIES)}")
    if _DONE.issuperset(names):
        return None

    def run() -> None:
        try:
            import_ray_library(*names)
        except Exception as exc:  # noqa: BLE001 - reported where the library is used
            logging.getLogger(__name__).debug("prefetching %s failed: %s", names, exc)

    thread = threading.Thread(target=run, name="unirl-prefetch-imports", daemon=True)
    thread.start()
    return thread
