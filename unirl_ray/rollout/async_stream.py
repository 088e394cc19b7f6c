"""The rollout slab of the async trainers: a Ray Data stream prompts -> rollout -> reward -> sample cache.

One row per train step ``j`` (its requests: prompts x group_size with fixed seeds) flows through
one Ray Data actor stage, ``RolloutStage``, while the Ray Train slab trains. For each row it

- waits on the ``VersionGate`` until the trainer has published a policy version
  ``>= j - 1 - max_staleness`` (admission control: the batch can then never be more than
  ``max_staleness`` versions old when train step ``j`` uses it, whose weights are version ``j - 1``),
  then generates on the dedicated engine app with that version or a newer one. Each sample is
  tagged with the version that generated it (read under the replica's lock, so a weight load
  waits for a generation in flight: never a mix of two versions inside one sample);
- scores the samples on the reward app(s) (rule rewards in the stage's own process).

Rollout and reward share the stage on purpose: a second actor stage for the reward cost more CPU
per sample than the overlap it bought (each Ray Data actor operator adds its own task, block and
scheduling work on every row; bench/README.md has the measurement), and the overlap that matters,
generation next to training, does not need it.

The driver's consumer thread moves finished rows into the bounded ``SampleCache`` (at most
``max_staleness + 1`` steps are ever ahead of training: the gate guarantees it, the cache enforces
it). Weights are published by the trainer at explicit barriers (``sync.every`` steps): the gate
opens for the next batches only once every engine replica serves the new version (verified).

Partial rollouts (a weight update lands while a chunk is being generated), per ``partial_rollout``:
``finish``: the chunk finishes with the weights it started with and its samples carry that
version; ``resample``: such samples are thrown away and generated again (same seeds) with the new
version, counted in ``async/samples_resampled``.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from unirl_ray.core.sample import Sample
from unirl_ray.runtime.cluster import on_driver_node
from unirl_ray.runtime.imports import import_ray_library
from unirl_ray.runtime.version_gate import VersionGate

log = logging.getLogger(__name__)

STAGE_NUM_CPUS = 0.05
"""CPUs each stage actor asks for: they only wait on Serve apps (the engine and reward replicas do the work)."""


def _dumps(obj: Any) -> bytes:
    return ray.cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: Any) -> Any:
    return pickle.loads(bytes(data))  # rows of this job's own stages only


class RolloutStage:
    """Ray Data actor stage: admission by version, generation on the engine app, partial-rollout
    policy, then scoring on the reward app(s) (``sample.reward`` / ``rewards``) when ``reward`` is given."""

    def __init__(self, engine: Any, gate: Any, max_staleness: int, partial_rollout: str, timeout_s: float,
                 reward: Any = None) -> None:
        self.engine, self.gate, self.reward = engine, gate, reward
        self.max_staleness, self.partial_rollout, self.timeout_s = max_staleness, partial_rollout, timeout_s
        self.last_end: float | None = None  # when the previous batch finished generating (this process's clock)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"step": [], "payload": [], "info": []}
        for step, payload in zip(batch["step"], batch["payload"]):
            samples, info = self.rollout(int(step), _loads(payload))
            if self.reward is not None:  # the engine is idle meanwhile: counted in the next batch's idle_s
                info["reward_metrics"] = self.reward.score(samples)
            out["step"].append(int(step))
            out["payload"].append(_dumps(samples))
            out["info"].append(_dumps(info))
        return out

    def rollout(self, step: int, requests: list[dict[str, Any]]) -> tuple[list[Sample], dict[str, float]]:
        min_version = max(0, step - 1 - self.max_staleness)
        t0 = time.perf_counter()
        idle = 0.0 if self.last_end is None else t0 - self.last_end  # scoring the last batch, waiting for this one
        ray.get(self.gate.wait_for.remote(min_version, self.timeout_s), timeout=self.timeout_s + 60)
        t1 = time.perf_counter()
        samples = self.engine.generate(requests, min_version=min_version)
        resampled = 0
        if self.partial_rollout == "resample":
            for _ in range(3):  # bounded: a newer version can land again while regenerating
                latest = ray.get(self.gate.current.remote(), timeout=60)
                stale = [i for i, s in enumerate(samples) if s.policy_version < latest]
                if not stale:
                    break
                fresh = self.engine.generate([requests[i] for i in stale], min_version=latest)
                for i, sample in zip(stale, fresh):
                    samples[i] = sample
                resampled += len(stale)
        t2 = time.perf_counter()
        self.last_end = t2
        return samples, {"wait_s": t1 - t0, "generate_s": t2 - t1, "idle_s": idle + t1 - t0, "finished_at": time.time(),
                         "resampled": float(resampled), "min_version": float(min_version)}


@dataclass
class Entry:
    """One step's scored samples and how they were made."""

    step: int
    """The train step these samples are for."""
    samples: list[Sample]
    """Scored samples, each tagged with the policy version that generated it."""
    info: dict[str, Any] = field(default_factory=dict)
    """Timings of the rollout stage (``wait_s`` for the version gate, ``generate_s``, ``idle_s``: not generating
    since the previous batch, ``finished_at``: wall clock), ``resampled`` and ``reward_metrics``."""


class SampleCache:
    """Bounded, step-keyed cache of finished batches between the consumer thread and the trainer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[int, Entry] = {}
        self.error: BaseException | None = None
        self.closed = False
        self.cond = threading.Condition()
        self.max_depth = 0

    def put(self, entry: Entry, timeout_s: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.entries) < self.capacity or self.closed, timeout_s):
                raise TimeoutError(f"the sample cache stayed full ({self.capacity} steps) for {timeout_s:.0f}s")
            if entry.step in self.entries:
                raise RuntimeError(f"step {entry.step} arrived twice from the rollout stream")
            self.entries[entry.step] = entry
            self.max_depth = max(self.max_depth, len(self.entries))
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def depth(self) -> tuple[int, int]:
        """(steps, samples) ready now."""
        with self.cond:
            return len(self.entries), sum(len(e.samples) for e in self.entries.values())

    def take(self, step: int, timeout_s: float) -> Entry:
        with self.cond:
            ready = self.cond.wait_for(lambda: step in self.entries or self.error is not None, timeout_s)
            if step in self.entries:
                entry = self.entries.pop(step)
                self.cond.notify_all()
                return entry
            if self.error is not None:
                raise RuntimeError(f"the rollout stream failed before step {step}: {self.error}") from self.error
            assert not ready
            raise TimeoutError(f"no rollout batch for step {step} within {timeout_s:.0f}s (async_rollout.wait_timeout_s); "
                               "the rollout slab is stuck or far too slow: check the engine app with `serve status`")


class RolloutStream:
    """Driver side: the gate actor, the Ray Data pipeline over steps, the consumer thread and the cache."""

    def __init__(self, *, engine: Any, reward: Any, requests: dict[int, list[dict[str, Any]]], version: int,
                 max_staleness: int, partial_rollout: str, timeout_s: float, gate_name: str, namespace: str) -> None:
        import_ray_library("data")  # here, not in the consumer thread's first execution (see runtime.imports)
        import ray.data

        self.timeout_s = timeout_s
        self.gate = VersionGate.options(name=gate_name, namespace=namespace, **on_driver_node()).remote(version)
        self.cache = SampleCache(capacity=max_staleness + 1)
        steps = sorted(requests)
        self.generated = 0
        self.resampled = 0
        self.busy: list[tuple[float, float]] = []
        """Wall-clock (start, end) of every batch generation, in arrival order (benchmarks read it)."""
        items = [{"step": j, "payload": _dumps(requests[j])} for j in steps]
        ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))  # one step per block: streamed
        ds._context = ds.context.copy()  # noqa: SLF001 - this stream's own options, not the process-wide ones
        ds.context.execution_options.preserve_order = True
        ds.context.enable_progress_bars = False
        # One long-lived stage actor that runs the rows in step order. Ray Data lets map actors run their
        # tasks out of order by default; here that deadlocks: a row for step j + 1 that waits at the gate
        # for the version that training on step j publishes would block row j behind it.
        self.dataset = ds.map_batches(
            RolloutStage, batch_size=1, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=STAGE_NUM_CPUS,
            allow_out_of_order_execution=False,
            fn_constructor_kwargs={"engine": engine, "gate": self.gate, "max_staleness": max_staleness,
                                   "partial_rollout": partial_rollout, "timeout_s": timeout_s, "reward": reward},
        )
        self.thread = threading.Thread(target=self._consume, name="unirl-rollout-stream", daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        try:
            # Whole blocks (one step each), no prefetch: a prefetching iterator would wait for step j + 1
            # before handing over step j, whose training is what lets step j + 1 start (a deadlock).
            for block in self.dataset.iter_batches(batch_size=None, prefetch_batches=0, batch_format="numpy"):
                for step, payload, raw_info in zip(block["step"], block["payload"], block["info"]):
                    if self.cache.closed:
                        return
                    samples, info = _loads(payload), _loads(raw_info)
                    self.generated += len(samples)
                    self.resampled += int(info.get("resampled", 0))
                    self.busy.append((info["finished_at"] - info["generate_s"], info["finished_at"]))
                    self.cache.put(Entry(int(step), samples, info), self.timeout_s)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's next take()
            if not self.cache.closed:
                log.error("rollout stream failed: %s", exc)
            self.cache.fail(exc)

    def publish(self, version: int) -> None:
        """Open the gate for batches that may use ``version`` (after every replica serves it, verified)."""
        ray.get(self.gate.publish.remote(version), timeout=60)

    def take(self, step: int) -> Entry:
        return self.cache.take(step, self.timeout_s)

    def close(self, reason: str, join_timeout_s: float = 30.0) -> dict[str, int]:
        """Stop the stream; returns what was left unused ({"steps", "samples"} in the cache)."""
        self.cache.close()
        try:
            ray.get(self.gate.close.remote(reason), timeout=30)
        except Exception as exc:  # noqa: BLE001 - the gate may be gone with a dying cluster
            log.warning("closing the version gate: %s", exc)
        self.thread.join(join_timeout_s)
        steps, samples = self.cache.depth()
        try:
            ray.kill(self.gate)
        except Exception:  # noqa: BLE001
            pass
        return {"steps": steps, "samples": samples}
