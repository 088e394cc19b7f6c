"""One live job per run name on a cluster.

A run's Serve apps (``<run>-reward``, ``<run>-rollout``), its engine's weight store and its folder
under the storage path are named after ``trainer.run_name``. Two jobs running the same name at once
would replace each other's apps and share a weight store without a word, so the driver holds a named
actor, ``unirl-run-<name>``, for as long as the run is live. That actor is the run's command broker
(``runtime.broker.CommandBroker``, which its train workers find by that name): one process per run
does both. It is owned by the driver (not detached): a job that ends, fails or is killed releases it
with its driver, so resuming after a crash is never blocked by a stale lock.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from unirl_ray.runtime.broker import CommandBroker
from unirl_ray.runtime.cluster import on_driver_node
from unirl_ray.runtime.train_group import NAMESPACE  # the broker's: TrainGroup and the workers look it up there
RELEASE_WAIT_S = 10.0  # how long a lock this job just released may take to go


class RunNameInUse(RuntimeError):
    """Another live job on this cluster holds the run name."""


def lock_name(run_name: str) -> str:
    """The name of the lock (and command broker) actor of ``run_name``."""
    return f"unirl-run-{run_name}"


def acquire(run_name: str, timeout_s: float = 30.0, *, world_size: int = 1, niceness: int | None = None) -> Any:
    """The lock actor of ``run_name``: the command broker of its ``world_size`` train ranks (keep the handle;
    ``release`` it at the end; ``niceness`` as ``CommandBroker`` takes it). Raises ``RunNameInUse`` naming the
    job that holds it."""
    holder = {"job_id": ray.get_runtime_context().get_job_id()}
    name = lock_name(run_name)
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        try:
            actor = CommandBroker.options(name=name, namespace=NAMESPACE, get_if_exists=False,
                                          **on_driver_node()).remote(world_size, niceness=niceness, holder=holder)
            break
        except ValueError:  # the name is taken by a live actor
            other = _holder(name, timeout_s)
            # this job's own lock of a run that just ended (ray.kill is asynchronous), or one gone meanwhile
            if other.get("job_id") in (holder["job_id"], None) and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise RunNameInUse(
                f"a run named {run_name!r} is live on this cluster (job {other.get('job_id', '?')}): its Serve apps, weight "
                f"store and folder carry that name. Choose another trainer.run_name, or wait for / stop that job "
                f"(ray job stop {other.get('job_id', '<id>')}, or end its notebook kernel) to resume this one"
            ) from None
    # The name is registered (or refused, above) by .remote() itself; the actor's process starts while the
    # run deploys its services (waiting for it here put a process start before everything else).
    return actor


def _holder(name: str, timeout_s: float) -> dict[str, Any]:
    try:
        return ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - it ended meanwhile
        return {}


def release(actor: Any) -> None:
    if actor is not None:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already gone with its job
            pass
