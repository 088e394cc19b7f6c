"""Ray Serve plumbing shared by the reward service and the dedicated rollout engine: starting Serve
(HTTP off unless asked), deploying and deleting apps with bounded waits, and how often a stopping
replica polls for requests still in flight."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from unirl_ray.runtime.timeouts import call_with_timeout

SHUTDOWN_POLL_S = 0.2
"""How often a stopping replica checks for requests still in flight (Serve's default, 2 s, made
every app deletion wait ~2 s per replica even when idle; the timeout for in-flight work is unchanged)."""

STATUS_POLL_S = 0.1
"""How often a deploy or a deletion checks the app's status. ``serve.run`` and ``serve.delete`` poll every
1 s, so each deploy waited ~0.5 s and each deletion ~1 s longer than the app took."""


_START_LOCK = threading.Lock()

_BUILD_LOCK = threading.RLock()

BUILD_TIMEOUT_S = 120.0
"""The longest a Serve build waits for another thread's (``serve_build``)."""


@contextlib.contextmanager
def serve_build(what: str, timeout_s: float = BUILD_TIMEOUT_S) -> Iterator[None]:
    """Held while a Serve deployment or app is built (``serve.deployment``, ``.options``, ``.bind``) or submitted
    (``run_app``): Ray Serve serializes each deployment config's request router by registering its module in
    cloudpickle's process-wide pickle-by-value registry and unregistering it after, so two threads building at once
    (a reward app and a rollout engine deploying in parallel) failed with "<module ...request_router> is not
    registered for pickle by value" when the second one unregistered what the first had. TimeoutError naming
    ``what`` when another build holds it longer than ``timeout_s`` (a submission whose Serve controller does not
    answer)."""
    if not _BUILD_LOCK.acquire(timeout=max(timeout_s, 0.0)):
        raise TimeoutError(f"{what}: another Serve app's build or submission in this process did not finish within "
                           f"{timeout_s:.0f}s")
    try:
        yield
    finally:
        _BUILD_LOCK.release()


def start_serve(http_port: int | None = None, host: str = "127.0.0.1") -> None:
    """Start Serve with HTTP off (default), or with one proxy bound to ``host``:``http_port`` (loopback unless
    the caller names another address).

    If Serve already runs in this cluster its settings are kept (Serve logs a warning). Thread-safe:
    deploys running in parallel threads (a reward app and a rollout engine) start one controller.
    """
    from ray import serve

    with _START_LOCK:
        if http_port is None:
            serve.start(proxy_location="Disabled")
        else:
            serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": int(http_port)})


def _app_statuses() -> dict[str, Any]:
    from ray import serve

    return serve.status().applications


def run_app(app: Any, name: str, *, route_prefix: str | None, timeout_s: float) -> Any:
    """``serve.run(app, name=, route_prefix=)`` that returns as soon as the app is RUNNING; returns its handle.

    TimeoutError after ``timeout_s`` (the caller deletes the app), RuntimeError if Serve reports
    DEPLOY_FAILED (its message included), as ``serve.run`` raises.
    """
    from ray import serve

    deadline = time.monotonic() + timeout_s

    def deploy() -> Any:
        with serve_build(f"deploy-{name}", deadline - time.monotonic()):
            target = serve.RunTarget(app, name=name, route_prefix=route_prefix)
            # submitted only: the loop below waits for it (bounded), not Serve (which waits without a timeout)
            handle = serve.run_many([target], wait_for_ingress_deployment_creation=False,
                                    wait_for_applications_running=False)[0]
        while True:
            status = _app_statuses().get(name)
            if status is not None and status.status == "RUNNING":
                return handle
            if status is not None and status.status == "DEPLOY_FAILED":
                raise RuntimeError(f"Deploying application {name} failed: {status.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"deploy-{name} did not finish within {timeout_s} s")
            time.sleep(STATUS_POLL_S)

    return call_with_timeout(deploy, timeout_s + 5, f"deploy-{name}")


def delete_apps(names: Sequence[str], *, timeout_s: float = 60.0) -> None:
    """Delete the Serve apps ``names`` together and wait until all are gone; TimeoutError naming those
    left. Names of apps that do not exist are fine."""
    names = list(dict.fromkeys(names))
    if not names:  # (before importing Serve: a run without Serve apps never pays for it, ~1.3 CPU-s)
        return
    from ray import serve

    deadline = time.monotonic() + timeout_s

    def delete() -> None:
        for name in names:
            serve.delete(name, _blocking=False)
        while True:
            statuses = _app_statuses()
            left = [n for n in names if n in statuses and statuses[n].status != "NOT_STARTED"]
            if not left:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Serve apps {left} were not deleted within {timeout_s} s")
            time.sleep(STATUS_POLL_S)

    call_with_timeout(delete, timeout_s + 5, f"delete-{'-'.join(names)}")
