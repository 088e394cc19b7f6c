"""The command broker between the driver (controller) and the Ray Train worker group.

A zero-CPU async actor with one command queue per rank. The driver submits a command to every rank
and collects one result per rank; workers long-poll for commands. Worker generations fence
commands across a worker-group restart: a (re)started worker announces itself, which drops its
queued commands and answers the commands it can no longer finish with ``{"fenced": True}``.

Every wait here is bounded: long-polls return ``None`` after ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
from typing import Any

import ray

from unirl_ray.core.wire import wire
from unirl_ray.runtime.cluster import set_niceness

INLINE_MAX_BYTES = 256 << 10
"""Payloads and results up to this size ride inline in the broker calls; larger ones go through the
object store (the broker then only holds a reference)."""


def pack(obj: Any) -> dict[str, Any]:
    """Serialise ``obj`` once: ``{"_bytes": ...}`` inline when small, else ``{"_ref": ...}`` to the bytes.

    Inline bytes save the object-store round trips (a put here, a fetch from this process there)
    that dominate a small command's latency; the broker never deserialises either form.
    """
    data = ray.cloudpickle.dumps(wire(obj), protocol=pickle.HIGHEST_PROTOCOL)  # tensors as numpy: fast
    return {"_bytes": data} if len(data) <= INLINE_MAX_BYTES else {"_ref": ray.put(data)}


def unpack(box: dict[str, Any], timeout_s: float = 600.0) -> Any:
    """The object ``pack`` boxed (payloads and results travel only between this job's own processes)."""
    data = box["_bytes"] if "_bytes" in box else ray.get(box["_ref"], timeout=timeout_s)
    return pickle.loads(data)


@ray.remote(num_cpus=0, max_concurrency=64)
class CommandBroker:
    """Per-rank command queues, result slots and the worker announce protocol."""

    def __init__(self, world_size: int, niceness: int | None = None, holder: dict[str, Any] | None = None) -> None:
        """``niceness``: this process's scheduling priority (``ray.worker_niceness``: the workers' own; at
        Ray's default of 15 a busy machine delayed every command's hand-over by ~10 ms). ``holder``: who holds
        the run name when this broker is also the run's lock (``runtime.run_lock``), as ``info`` returns it."""
        set_niceness(niceness, "command broker")
        self.holder = dict(holder or {})
        self.world_size = world_size
        self.queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(world_size)]
        self.results: dict[int, dict[int, Any]] = {}
        self.pending: dict[int, set[int]] = {}
        self.announced: dict[int, dict[str, Any]] = {}
        self.generations: dict[int, int] = {}
        self.ids = itertools.count(1)
        self.changed = asyncio.Condition()
        self.closed = False

    # ------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """No more commands: every rank's next poll (and any rank that starts later) gets ``stop``."""
        self.closed = True

    async def is_closed(self) -> bool:
        return self.closed

    async def info(self) -> dict[str, Any]:
        """Who holds the run name (``runtime.run_lock``)."""
        return self.holder

    async def niceness(self) -> int:
        """This process's scheduling priority."""
        return os.nice(0)

    # ---------------------------------------------------------------- workers
    async def announce(self, rank: int, info: dict[str, Any]) -> int:
        """A worker (re)started: fence its old work; returns its generation (tag for results)."""
        async with self.changed:
            self.generations[rank] = self.generations.get(rank, -1) + 1
            self.queues[rank] = asyncio.Queue()
            for cmd_id, ranks in self.pending.items():
                if rank in ranks:
                    self.results.setdefault(cmd_id, {})[rank] = {"fenced": True}
            self.announced[rank] = dict(info, generation=self.generations[rank])
            self.changed.notify_all()
            return self.generations[rank]

    async def next_command(self, rank: int, timeout_s: float) -> dict[str, Any] | None:
        if self.closed:
            return {"id": 0, "op": "stop", "payload": None}
        try:
            return await asyncio.wait_for(self.queues[rank].get(), timeout=timeout_s)
        except asyncio.TimeoutError:
            return None

    async def post_result(self, rank: int, generation: int, cmd_id: int, result: Any) -> None:
        async with self.changed:
            if generation != self.generations.get(rank):
                return  # a worker of an older generation: its result is void
            if cmd_id in self.pending and rank not in self.results.get(cmd_id, {}):
                self.results.setdefault(cmd_id, {})[rank] = result
                self.changed.notify_all()

    # ----------------------------------------------------------------- driver
    async def announcements(self) -> dict[int, dict[str, Any]]:
        return dict(self.announced)

    async def clear_announcements(self) -> None:
        self.announced = {}

    async def submit(self, op: str, payloads: list[Any]) -> int:
        """Queue ``op`` for every rank with that rank's payload; returns the command id."""
        if len(payloads) != self.world_size:
            raise ValueError(f"need one payload per rank ({self.world_size}), got {len(payloads)}")
        cmd_id = next(self.ids)
        self.pending[cmd_id] = set(range(self.world_size))
        for rank, payload in enumerate(payloads):
            self.queues[rank].put_nowait({"id": cmd_id, "op": op, "payload": payload})
        return cmd_id

    async def submit_and_collect(self, op: str, payloads: list[Any], timeout_s: float) -> tuple[int, list[Any] | None]:
        """``submit`` then ``collect`` in one call (one round trip less per command): the command id and the
        results, or None when they are not all in after ``timeout_s`` (``collect`` goes on waiting)."""
        cmd_id = await self.submit(op, payloads)
        return cmd_id, await self.collect(cmd_id, timeout_s)

    async def collect(self, cmd_id: int, timeout_s: float) -> list[Any] | None:
        """All ranks' results of ``cmd_id`` once complete (then forgotten), else ``None`` after the timeout."""
        async with self.changed:
            try:
                done = lambda: len(self.results.get(cmd_id, {})) == self.world_size  # noqa: E731
                await asyncio.wait_for(self.changed.wait_for(done), timeout_s)
            except asyncio.TimeoutError:
                return None
            results = self.results.pop(cmd_id)
            self.pending.pop(cmd_id, None)
            return [results[r] for r in range(self.world_size)]
