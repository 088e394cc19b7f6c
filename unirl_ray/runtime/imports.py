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
                    if "._internal" not in module:
                        raise
            _DONE.add(name)
