"""Bounded waits for blocking calls that take no timeout of their own (e.g. ``serve.run``)."""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run a blocking Serve control call in a thread; TimeoutError instead of a hang."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"unirl-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["value"]
