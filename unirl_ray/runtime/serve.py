"""Ray Serve plumbing shared by the reward service and the dedicated rollout engine: starting Serve
(HTTP off unless asked) and how often a stopping replica polls for requests still in flight."""

from __future__ import annotations

import threading

SHUTDOWN_POLL_S = 0.2
"""How often a stopping replica checks for requests still in flight (Serve's default, 2 s, made
every app deletion wait ~2 s per replica even when idle; the timeout for in-flight work is unchanged)."""


_START_LOCK = threading.Lock()


def start_serve(http_port: int | None = None) -> None:
    """Start Serve with HTTP off (default), or with one proxy bound to 127.0.0.1:``http_port``.

    If Serve already runs in this cluster its settings are kept (Serve logs a warning). Thread-safe:
    deploys running in parallel threads (a reward app and a rollout engine) start one controller.
    """
    from ray import serve

    with _START_LOCK:
        if http_port is None:
            serve.start(proxy_location="Disabled")
        else:
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": int(http_port)})
