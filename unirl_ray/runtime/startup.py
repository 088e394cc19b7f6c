"""Where a run's start-up time goes: milestones in seconds since the driver process started.

``BaseTrainer.setup`` marks each milestone as it is reached (``mark``); after the first step the
trainer logs them to MLflow (``startup/<milestone>_s``, at that step) and prints one line, so a user
iterating on a recipe sees what the seconds before the first step were spent on, and
``bench/cold_start.py`` reads the same numbers. Milestones, in the order a fresh run reaches them:

- ``setup``: ``setup()`` entered (the driver's imports and the recipe load are before it);
- ``ray``: Ray joined or started;
- ``workers``: every train rank built its model and announced;
- ``services``: the reward app(s) and rollout engines deployed (they build while the workers start) and
  the engines hold the workers' weights;
- ``tracking``: the MLflow run open (its store prepared while the workers started);
- ``first_step``: the first step trained and logged.

Background deploys mark when they finished (``reward_app``, ``engine``), which says whether they or the
workers were on the critical path.
"""

from __future__ import annotations

import os
import threading
import time

MILESTONES = ("setup", "ray", "workers", "services", "tracking", "first_step")


def process_start_time() -> float:
    """Wall-clock time (``time.time()``) at which this process started; now if it cannot be read."""
    try:
        with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: clock ticks after boot (field 22; fields[0] is field 3)
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux
        return time.time()


_started_one = False  # whether a run of this process already started (its clock took the process start)


class StartupClock:
    """Milestones of one run's start, in seconds since ``origin``.

    By default the origin is the process start for the first run a process starts (a command, a job) and
    that run's ``setup()`` for later ones (the next run of a notebook kernel or a test session, whose
    process start says nothing about them); ``since_process`` says which.
    """

    def __init__(self, origin: float | None = None) -> None:
        global _started_one
        self.since_process = origin is None and not _started_one
        _started_one = True
        self.origin = origin if origin is not None else process_start_time() if self.since_process else time.time()
        self.marks: dict[str, float] = {}
        self._lock = threading.Lock()  # background deploys mark from their own threads

    def mark(self, name: str) -> float:
        """Record milestone ``name`` now (the first time only: a restart does not move it); its offset."""
        with self._lock:
            return self.marks.setdefault(name, time.time() - self.origin)

    def metrics(self) -> dict[str, float]:
        """``{"startup/<milestone>_s": offset}`` for every milestone reached."""
        return {f"startup/{name}_s": value for name, value in self.marks.items()}

    def summary(self) -> str:
        """One line: the first step's offset, then each milestone's (in the order reached)."""
        order = sorted(self.marks.items(), key=lambda kv: kv[1])
        parts = " | ".join(f"{name} {value:.1f}" for name, value in order)
        first = self.marks.get("first_step")
        since = "the process started" if self.since_process else "setup() began"
        head = f"first step {first:.1f}s after {since}" if first is not None else "start-up"
        return f"{head} (seconds: {parts})"
