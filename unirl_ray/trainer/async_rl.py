"""Async RL: two slabs (Ray Train for training, a Ray Serve engine app for rollout), versioned
samples, bounded staleness. One mechanism for AR and diffusion (``AsyncARTrainer``,
``AsyncDiffusionTrainer`` only add their family's metrics and media through ``ARTrainer`` /
``DiffusionTrainer``).

While the train slab trains step ``k`` (on weights version ``k - 1``), the rollout slab already
generates the next batches: the engine's ``RolloutManager`` in stream mode (``rollout.manager``; a Ray
Data stream of steps, ``unirl_ray.rollout.async_stream``) with prompts -> rollout on the engine app ->
reward, into a bounded sample cache. A batch for step
``j`` may only start once version ``j - 1 - max_staleness`` is published, so every sample the
trainer takes is at most ``max_staleness`` versions old; the trainer checks this on every sample
(and that no sample is trained twice) before training. Weights are published at explicit
barriers: every ``sync.every`` train steps the train ranks export, then (in the background, while
the next step trains) every engine replica loads and verifies the new version after the generation it
is running, and only then does the gate let the stream use it. ``max_staleness: 0`` with
``sync.every: 1`` is the synchronous trainer, number for number.

Stale samples need an off-policy correction in the loss: set ``algorithm.off_policy: {mode:
decoupled}`` (``unirl_ray.algorithms.off_policy``); its importance-weight statistics are logged.

Metrics (MLflow): ``async/staleness/<v>`` (samples of staleness v this step: the histogram),
``async/staleness_mean|max``, ``async/cache_depth`` / ``async/cache_depth_samples`` (batches ready
when the step began), ``async/train_idle_ratio`` (share of the step spent waiting for samples),
``async/rollout_idle_ratio`` (share of the time between the end of the previous batch's generation
and the end of this one's in which the rollout slab did not generate: waiting for a version or for
the stream), ``perf/rollout_samples_per_s`` and ``perf/train_samples_per_s`` (each slab
while busy), ``timing/weight_sync``, running totals ``async/samples_generated|trained|resampled``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from unirl_ray.config.checks import check_literal_fields
from unirl_ray.config.recipe import RecipeError
from unirl_ray.core.sample import Sample
from unirl_ray.trainer.ar import ARTrainer
from unirl_ray.trainer.base import console
from unirl_ray.trainer.diffusion import DiffusionTrainer
from unirl_ray.trainer.rl import RLTrainer

log = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    """A sample older than ``max_staleness`` versions (or from the future) reached training."""


@dataclass(kw_only=True)
class AsyncConfig:
    """The ``async_rollout:`` block of an async recipe."""

    max_staleness: int = 1
    """Most policy versions a trained-on sample may lag the trainer's weights (0: synchronous)."""
    partial_rollout: Literal["finish", "resample"] = "finish"
    """A generation in flight when new weights are published: ``finish`` (it completes with the weights
    it started with; its samples carry that version) or ``resample`` (its samples are generated again
    with the new weights, same seeds)."""
    wait_timeout_s: float = 600.0
    """Longest wait of the trainer for a batch, and of the rollout for a policy version."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"async_rollout.max_staleness must be an int >= 0, got {self.max_staleness!r}")
        check_literal_fields(self, "async_rollout")
        if not self.wait_timeout_s > 0:
            raise ValueError(f"async_rollout.wait_timeout_s must be > 0, got {self.wait_timeout_s}")


class AsyncRLTrainer(RLTrainer):
    """The async mechanism over ``RLTrainer``'s step: samples come from the rollout stream."""

    driver_sections = (*RLTrainer.driver_sections, "async_rollout")

    def optional_sections(self) -> set[str]:
        return super().optional_sections() | {"async_rollout"}

    def validate_domain(self) -> None:
        super().validate_domain()
        self.async_cfg: AsyncConfig = (
            self._build("async_rollout") if self.recipe.get("async_rollout") is not None else AsyncConfig()
        )
        if self.dedicated is None or self.dedicated.placement != "separate":
            raise RecipeError(
                f"{type(self).__name__} rolls out on its own slab: set rollout._target_=unirl_ray.rollout.DedicatedRollout "
                "with placement: separate (trainside / colocated rollouts cannot run while the workers train)"
            )
        every = self.sync.every
        if self.async_cfg.max_staleness < every - 1:
            raise RecipeError(
                f"async_rollout.max_staleness={self.async_cfg.max_staleness} is below sync.every - 1 = {every - 1}: "
                f"weights are published every {every} steps, so samples are up to {every - 1} versions old; raise "
                "max_staleness or publish more often"
            )
        correction = getattr(getattr(self.algorithm, "off_policy", None), "mode", None)
        if self.async_cfg.max_staleness > 0 and correction == "none":
            log.warning("async_rollout.max_staleness=%d without an off-policy correction: set algorithm.off_policy="
                        "{mode: decoupled} to weight stale samples by pi_prox / pi_behav", self.async_cfg.max_staleness)

    # ------------------------------------------------------------ lifecycle
    def setup(self) -> int:
        start = super().setup()
        self._start_stream(start)
        return start

    def _start_stream(self, start: int, trained_ids: dict[int, set[str]] | None = None) -> None:
        from unirl_ray.runtime.train_group import NAMESPACE

        self._requests_rows: dict[int, list[str]] = {}
        self._data_states: dict[int, dict[str, Any]] = {start: self.data.state_dict()}
        requests: dict[int, list[dict[str, Any]]] = {}
        for step in range(start + 1, self.run_cfg.num_steps + 1):  # prompts are cheap: draw every step's now
            rows = self.data.next_batch(self.prompts_per_step)
            self._requests_rows[step] = [row["prompt"] for row in rows]
            requests[step] = self.make_requests(step, rows)
            self._data_states[step] = self.data.state_dict()
        self._trained_ids: dict[int, set[str]] = dict(trained_ids or {})  # per step: rewound on a restart
        self._publish_thread: threading.Thread | None = None
        self._publish_error: BaseException | None = None
        self._publish_seconds: float | None = None
        self._seen_ids: set[str] = set().union(*self._trained_ids.values()) if self._trained_ids else set()
        self._last_step = start
        self._totals = {"trained": 0}
        self.manager = self.rollout_manager(self.engine)
        self.stream = self.manager.stream(
            requests, reward=self.reward, version=self.policy_version,
            max_staleness=self.async_cfg.max_staleness, partial_rollout=self.async_cfg.partial_rollout,
            timeout_s=self.async_cfg.wait_timeout_s, gate_name=f"{self.run_cfg.run_name}-gate", namespace=NAMESPACE,
        )

    def teardown(self, status: str) -> None:
        try:
            self._finish_publish()
        except Exception as exc:  # noqa: BLE001 - ending anyway
            log.warning("the last weight publish failed: %s", exc)
        stream = getattr(self, "stream", None)
        if stream is not None:
            left = self.manager.close_stream(f"trainer {status.lower()}") or {"steps": 0, "samples": 0}
            console(f"async rollout: {stream.generated} samples generated, {self._totals['trained']} trained, "
                    f"{stream.resampled} regenerated after a weight update, {left['samples']} left unused in the "
                    f"cache ({left['steps']} steps)")
            self.stream = None
        super().teardown(status)

    def controller_state(self) -> dict[str, Any]:
        # the data cursor after the last *trained* step: batches still in the stream are drawn again on resume
        state = super().controller_state()
        if getattr(self, "_data_states", None):  # before the stream starts the cursor is the data source's own
            state["data"] = self._data_states[self._last_step]
        return state

    def published(self, version: int) -> None:
        if self.stream is not None:
            self.manager.publish(version)

    def publish_weights(self) -> dict[str, float]:
        """The barrier without stalling training: the train ranks export now (fast); loading into every
        replica, which waits for a generation in flight to finish, and opening the gate run in the
        background while the next step trains. The next publish first waits for this one."""
        waited = self._finish_publish()
        version = self.policy_version
        ref, checksum, metrics = self.sync.export(self.group, version, store=self.engine.store_id)

        def load() -> None:
            t0 = time.perf_counter()
            try:
                self.engine.publish(version, ref, checksum, timeout_s=self.sync.timeout_s)
                self.published(version)
            except BaseException as exc:  # noqa: BLE001 - raised on the trainer's thread by _finish_publish
                self._publish_error = exc  # the gate stays shut: a trainer waiting for the next batch fails now
                self.manager.fail_stream(RuntimeError(f"publishing weights v{version} failed: {exc}"))
            self._publish_seconds = time.perf_counter() - t0

        self._publish_thread = threading.Thread(target=load, name=f"unirl-publish-v{version}", daemon=True)
        self._publish_thread.start()
        metrics["async/publish_wait_s"] = waited
        metrics["timing/weight_sync"] = metrics["weight_sync/export_seconds"] + waited  # what the trainer spent
        if self._publish_seconds is not None:
            metrics["weight_sync/seconds"] = self._publish_seconds  # the previous version's load on the engine
        return metrics

    def _finish_publish(self) -> float:
        """Wait for the publish in flight (bounded by sync.timeout_s); re-raise its error; seconds waited."""
        thread = getattr(self, "_publish_thread", None)
        t0 = time.perf_counter()
        if thread is not None:
            thread.join(self.sync.timeout_s + 60)
            if thread.is_alive():
                raise TimeoutError(f"the rollout replicas did not load the new weights within {self.sync.timeout_s:.0f}s "
                                   "(sync.timeout_s)")
            self._publish_thread = None
        error, self._publish_error = getattr(self, "_publish_error", None), None
        if error is not None:
            raise error
        return time.perf_counter() - t0

    def after_restart(self, announced: dict[str, Any], restored_step: int) -> None:
        """A worker-group restart rewinds training to a checkpoint: drop the stream (its batches were made
        for steps that run again), republish the checkpoint's weights, stream again from its data cursor."""
        try:
            self._finish_publish()
        except Exception as exc:  # noqa: BLE001 - the checkpoint's weights are published again below
            log.warning("a weight publish failed during the restart: %s", exc)
        left = self.manager.close_stream("the train worker group restarted") or {"steps": 0, "samples": 0}
        log.warning("async rollout: discarding %d cached samples after the worker-group restart", left["samples"])
        self.stream = None
        self._trained_ids = {k: v for k, v in self._trained_ids.items() if k <= restored_step}
        super().after_restart(announced, restored_step)
        self._start_stream(restored_step, trained_ids=self._trained_ids)

    # ------------------------------------------------------------- one step
    def collect(self, step: int) -> tuple[list[Sample], dict[str, Any]]:
        depth_steps, depth_samples = self.stream.cache.depth()
        t0 = time.perf_counter()
        entry = self.manager.take(step)
        waited = time.perf_counter() - t0
        samples, info = entry.samples, entry.info
        self.prompt_log.append((step, self._requests_rows.pop(step)))
        staleness = self._check(step, samples)
        self._rollout_idle = info["idle_s"] / max(info["idle_s"] + info["generate_s"], 1e-9)
        metrics: dict[str, Any] = {"timing/rollout": info["generate_s"], "timing/rollout_wait": info["wait_s"],
                                   **self.rollout_metrics(samples), **info["reward_metrics"]}
        metrics |= {f"async/staleness/{v}": float(staleness.count(v)) for v in range(self.async_cfg.max_staleness + 1)}
        metrics |= {
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/cache_depth": float(depth_steps),
            "async/cache_depth_samples": float(depth_samples),
            "async/train_wait_s": waited,
            "async/samples_generated": float(self.stream.generated),
            "async/samples_resampled": float(self.stream.resampled),
            "perf/rollout_samples_per_s": len(samples) / max(info["generate_s"], 1e-9),
        }
        return samples, metrics

    def _check(self, step: int, samples: list[Sample]) -> list[int]:
        """Staleness of every sample (bounded, never negative) and no sample trained twice."""
        current = self.policy_version
        staleness = [current - s.policy_version for s in samples]
        bad = [(s.sample_id, s.policy_version) for s, lag in zip(samples, staleness)
               if not 0 <= lag <= self.async_cfg.max_staleness]
        if bad:
            raise StalenessError(f"step {step} (weights v{current}) got samples outside max_staleness="
                                 f"{self.async_cfg.max_staleness}: {bad[:5]}")
        ids = [s.sample_id for s in samples]
        twice = sorted(set(ids) & self._seen_ids) + sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise StalenessError(f"step {step}: samples {twice[:5]} were already trained on")
        self._trained_ids[step] = set(ids)
        self._seen_ids.update(ids)
        return staleness

    def run_step(self, step: int) -> dict[str, Any]:
        metrics = super().run_step(step)
        self._last_step = step
        trained = len(self.prompt_log[-1][1]) * self.group_size
        self._totals["trained"] += trained
        metrics |= {
            "async/train_idle_ratio": metrics["async/train_wait_s"] / max(metrics["timing/step"], 1e-9),
            "async/rollout_idle_ratio": self._rollout_idle,
            "async/samples_trained": float(self._totals["trained"]),
            "perf/train_samples_per_s": trained / max(metrics["timing/train"], 1e-9),
        }
        return metrics


class AsyncARTrainer(AsyncRLTrainer, ARTrainer):
    """Async GRPO-family training of causal LMs (``python -m unirl_ray.train_async_ar``)."""

    domain = "async_ar"


class AsyncDiffusionTrainer(AsyncRLTrainer, DiffusionTrainer):
    """Async Flow-GRPO / DiffusionNFT training of diffusion models (``python -m unirl_ray.train_async_diffusion``)."""

    domain = "async_diffusion"
