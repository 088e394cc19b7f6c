"""``VersionGate``: the latest policy version every engine replica serves; the async trainers' rollout stages
wait on it (``rollout.async_stream``).

Its own module, importing only Ray: an actor's process imports the module that defines its class, and
``rollout.async_stream`` (like the ``unirl_ray.rollout`` package) imports torch, ~1.7 CPU-s more in a process
that only keeps a number and a condition (measured: 2.5 CPU-s to start the gate actor there, 0.8 here,
as a bare actor).
"""

from __future__ import annotations

import asyncio

import ray


class StreamClosed(RuntimeError):
    """The trainer closed the stream (it finished or failed); stages stop waiting."""


@ray.remote(num_cpus=0)
class VersionGate:
    """The latest policy version every engine replica serves; rollout stages wait on it."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.closed: str | None = None
        self.changed = asyncio.Condition()

    async def publish(self, version: int) -> int:
        async with self.changed:
            if version < self.version:
                raise ValueError(f"versions must not go back: published v{self.version}, got v{version}")
            self.version = version
            self.changed.notify_all()
        return self.version

    async def close(self, reason: str) -> None:
        async with self.changed:
            self.closed = reason
            self.changed.notify_all()

    async def current(self) -> int:
        return self.version

    async def wait_for(self, version: int, timeout_s: float) -> int:
        """The current version once it is ``>= version``; raises ``StreamClosed`` / ``TimeoutError``."""
        async with self.changed:
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: self.version >= version or self.closed is not None), timeout_s
                )
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"the rollout waited {timeout_s:.0f}s for policy version {version} (the trainer has published "
                    f"v{self.version}); training is stuck or much slower than async_rollout.wait_timeout_s allows"
                ) from None
            if self.closed is not None:
                raise StreamClosed(self.closed)
            return self.version
