"""How a rank object tells the runtime which commands it serves (Ray-free).

The runtime carries commands, fencing, checkpoints and recovery; what a rank *does* is the rank object's
business. A rank class marks its command methods with ``@operation``; the worker program dispatches a
command ``op`` with payload ``{name: value}`` as ``method(**payload)`` (``dispatch``), so a new domain adds
methods to its rank class and never touches ``runtime/``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__unirl_operation__"


def operation(fn: F) -> F:
    """Mark a rank method as a command the controller may send (``TrainGroup.call(name, payload)``)."""
    setattr(fn, _MARK, True)
    return fn


@functools.cache
def _served(cls: type) -> tuple[str, ...]:
    """The names of the marked methods of ``cls`` (looked up once per class, not per command)."""
    return tuple(name for name in dir(cls) if getattr(getattr(cls, name, None), _MARK, False))


def operations(rank: Any) -> dict[str, Callable[..., Any]]:
    """``{name: bound method}`` of the commands ``rank`` serves."""
    return {name: getattr(rank, name) for name in _served(type(rank))}


def dispatch(rank: Any, op: str, payload: dict[str, Any] | None) -> Any:
    """Run command ``op`` on ``rank`` with the payload's items as keyword arguments."""
    served = operations(rank)
    if op not in served:
        raise ValueError(f"unknown worker command {op!r}; {type(rank).__name__} serves {', '.join(sorted(served))}")
    if payload is not None and not isinstance(payload, dict):
        raise TypeError(f"the payload of command {op!r} must be a dict of keyword arguments, got {type(payload).__name__}")
    return served[op](**(payload or {}))
