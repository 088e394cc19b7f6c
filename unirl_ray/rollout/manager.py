"""``RolloutManager``: the one way a trainer rolls out on a dedicated engine, in three modes.

- ``generate(requests)``: a barrier batch of single-turn samples (ar, diffusion, pe, unified_model): the
  engine splits it over its replicas (``requests_per_call`` per call, ``max_ongoing_requests`` per
  replica); only the whole batch, in request order, comes back.
- ``run(requests)``: a barrier batch of multi-turn trajectories (agentic), below.
- ``stream(...)``: the async trainers' mode: a Ray Data stream of steps feeds a bounded sample cache
  while the trainer trains; a version gate admits a step's batch only once its weights are recent
  enough (``rollout.async_stream``); the trainer ``take``s each step's batch and ``publish``es versions.

In every mode every generated sample (and Part) carries the policy version that produced it, and
``quiesce()`` is called before every weight sync: in the barrier modes it waits until no engine call of
this manager is in flight; in stream mode the replicas themselves load new weights only after the
generation they are running (their lock), and ``partial_rollout`` decides what becomes of a batch that
straddles an update.

Multi-turn trajectories: one ``run(requests)`` takes a step's requests (each prompt ``group_size`` times) and returns one finished
trajectory per request, so only complete groups leave it. Inside, every trajectory is a small state machine:

    reset(row) -> [engine turn -> environment step (tools)]* -> answer

driven by one event loop on the controller: assistant turns go to the engine in calls of up to
``rollout.requests_per_call`` contexts, at most ``rollout.num_replicas x rollout.max_ongoing_requests`` calls
at a time; environment steps (tool calls) run on a pool of ``tool_workers`` threads, so a slow tool never
holds the engine and many trajectories' tools run at once. At most ``max_in_flight_per_replica x replicas``
trajectories are open at a time; the rest wait for a slot.

Token in, token out: each turn's context is the trajectory's ``TokenTranscript`` ids (the exact ids sampled
before it, plus the template's rendering of each observation alone), sent as ``prompt_ids``; nothing is ever
re-tokenised. A context that would not fit the engine's ``pipeline.max_prompt_tokens`` ends the trajectory
(``finish: context_full``). Every turn is tagged with the version of the weights that sampled it.

A trajectory fails (``failure`` says why) when its environment raises (a crashed tool, a tool past its time
limit), its engine call fails after the engine's retries, or it runs past ``trajectory_timeout_s``; the
others finish. ``quiesce()`` waits until no engine call is in flight: the trainer calls it before every weight
sync, so no turn is sampled while weights change.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from unirl_ray.agentic.environment import Environment
from unirl_ray.agentic.transcript import TokenTranscript
from unirl_ray.config.checks import PositiveInt
from unirl_ray.core.sample import Sample, TextPart

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class AgentRolloutConfig:
    """The ``agent:`` block of an agentic recipe: how the RolloutManager runs trajectories."""

    max_in_flight_per_replica: PositiveInt = 16
    """Trajectories open at a time per engine replica (the others wait for a slot)."""
    tool_workers: PositiveInt = 8
    """Environment steps (tool calls) that run at the same time, over all trajectories."""
    trajectory_timeout_s: float = 600.0
    """Longest a trajectory may take; past it, it fails (``failure: timed out``) and the others go on."""
    strict_check: bool = True
    """Render every finished conversation again and report how many differ from the ids trained
    (``agent/retokenize_mismatch_frac``: what re-tokenising would have broken; never an error)."""

    def __post_init__(self) -> None:
        if self.trajectory_timeout_s <= 0:
            raise ValueError(f"agent.trajectory_timeout_s must be > 0, got {self.trajectory_timeout_s}")


@dataclass(kw_only=True)
class Trajectory:
    """One request's conversation: its transcript, environment and how it ended."""

    request: dict[str, Any]
    env: Environment
    transcript: TokenTranscript
    versions: list[int] = field(default_factory=list)
    """Policy version of each assistant turn."""
    texts: list[str] = field(default_factory=list)
    """Each assistant turn's text as the environment read it."""
    turn_rewards: list[float | None] = field(default_factory=list)
    """The environment's own reward of each turn (``None``: none)."""
    finish: str = ""
    """How it ended: the environment's ``finish_reason`` (``ToolEnvironment``: ``answer``, ``max_turns``) or
    ``done``, else ``context_full`` or ``failed``."""
    failure: str | None = None
    deadline: float = 0.0
    seconds: float = 0.0
    answer: str = ""
    retokenize_mismatch: bool | None = None

    @property
    def turns(self) -> int:
        return len(self.transcript.turns)

    def to_sample(self, filler_id: int) -> Sample:
        """A Sample with one TextPart per assistant turn (its exact context and sampled ids; loss mask 0 on every
        turn of a failed trajectory) and the answer as the ``completions`` column the reward service scores.

        A trajectory that failed before its first turn gets one placeholder Part (``filler_id``, mask 0) so that
        every rank still trains on the same number of rows; no token of it is ever trained."""
        t = self.transcript
        parts = []
        if not t.turns:
            ids = list(t.ids) or [filler_id]
            parts.append(TextPart(prompt_ids=torch.tensor(ids, dtype=torch.long),
                                  completion_ids=torch.tensor([filler_id], dtype=torch.long),
                                  log_probs=torch.zeros(1), loss_mask=torch.zeros(1), text="", num_tokens=0))
        for k, span in enumerate(t.turns):
            n = span.end - span.start
            parts.append(TextPart(
                prompt_ids=torch.tensor(t.ids[: span.start], dtype=torch.long),
                completion_ids=torch.tensor(t.ids[span.start : span.end], dtype=torch.long),
                log_probs=torch.tensor(t.logprobs[span.start : span.end], dtype=torch.float32),
                loss_mask=torch.ones(n, dtype=torch.float32) if self.failure is None else torch.zeros(n),
                text=self.texts[k], num_tokens=n, policy_version=self.versions[k]))
        r = self.request
        return Sample(sample_id=r["sample_id"], group_id=r["group_id"], prompt=r["prompt"],
                      columns={**(r.get("columns") or {}), "completions": self.answer}, parts=parts,
                      policy_version=min(self.versions, default=-1))


class RolloutManager:
    """Rolls a trainer's requests out on ``engine`` (a ``DedicatedEngine``); see the module docstring.

    ``make_env`` / ``tokenizer`` / ``max_context_tokens`` are needed only by ``run`` (multi-turn)."""

    def __init__(self, engine: Any, *, make_env: Callable[[], Environment] | None = None, tokenizer: Any = None,
                 max_context_tokens: int = 0, cfg: AgentRolloutConfig | None = None,
                 turn_seed: Callable[[int, int], int] | None = None) -> None:
        self.engine, self.make_env, self.tokenizer = engine, make_env, tokenizer
        self.max_context_tokens, self.cfg = int(max_context_tokens), cfg or AgentRolloutConfig()
        self.active_stream: Any = None
        """The ``RolloutStream`` while in stream mode (``stream`` .. ``close_stream``), else None."""
        self.turn_seed = turn_seed or (lambda seed, turn: (int(seed) * 1_000_003 + turn) % (2**31 - 1))
        replicas = int(engine.cfg.num_replicas)
        self.max_open = self.cfg.max_in_flight_per_replica * replicas
        self.max_calls = max(1, int(engine.cfg.max_ongoing_requests) * replicas)
        self.per_call = int(engine.cfg.requests_per_call)
        self._engine_pool = cf.ThreadPoolExecutor(self.max_calls, thread_name_prefix="agent-engine")
        self._tool_pool = cf.ThreadPoolExecutor(self.cfg.tool_workers, thread_name_prefix="agent-tools")
        self._engine_calls: set[cf.Future] = set()
        self._calls_lock = threading.Lock()  # done-callbacks run on the engine threads
        self.peak_open = 0
        self.peak_calls = 0

    # ------------------------------------------------------------------ single-turn barrier batch
    def generate(self, requests: list[dict[str, Any]], *, min_version: int | None = None) -> list[Sample]:
        """One sample per request (in request order), from the engine's current version (or ``min_version`` or a
        newer one); counted as in flight for ``quiesce`` until it returns."""
        if self.active_stream is not None:
            raise RuntimeError("this RolloutManager is in stream mode: take() the stream's batches instead")
        future = self._engine_pool.submit(self.engine.generate, requests, min_version=min_version)
        self._track(future)
        samples = future.result()  # bounded by the engine's own per-call timeout and retries
        if [s.sample_id for s in samples] != [r["sample_id"] for r in requests]:
            raise RuntimeError("the engine returned samples out of order or incompletely")
        return samples

    # ------------------------------------------------------------------ stream mode (async trainers)
    def stream(self, requests: dict[int, list[dict[str, Any]]], *, version: int, max_staleness: int,
               partial_rollout: str, timeout_s: float, reward: Any, gate_name: str, namespace: str) -> Any:
        """Enter stream mode: every step's ``requests`` flow through the version gate, the engine and the
        reward app into the bounded cache (``rollout.async_stream``); returns the stream (its counters)."""
        from unirl_ray.rollout.async_stream import RolloutStream

        if self.active_stream is not None:
            raise RuntimeError("a stream is already running on this RolloutManager; close_stream() it first")
        self.active_stream = RolloutStream(
            engine=self.engine, reward=reward, requests=requests, version=version, max_staleness=max_staleness,
            partial_rollout=partial_rollout, timeout_s=timeout_s, gate_name=gate_name, namespace=namespace)
        return self.active_stream

    def take(self, step: int) -> Any:
        """Step ``step``'s scored batch (an ``async_stream.Entry``) once the stream has it."""
        if self.active_stream is None:
            raise RuntimeError("take() needs stream mode: call stream() first")
        return self.active_stream.take(step)

    def publish(self, version: int) -> None:
        """Every replica serves ``version`` (verified): in stream mode the gate now admits batches that need it."""
        if self.active_stream is not None:
            self.active_stream.publish(version)

    def fail_stream(self, error: BaseException) -> None:
        """The trainer's next ``take`` raises ``error`` (a weight publish failed: the gate stays shut)."""
        if self.active_stream is not None:
            self.active_stream.cache.fail(error)

    def close_stream(self, reason: str) -> dict[str, int] | None:
        """Leave stream mode; what was left unused (``{"steps", "samples"}``), None if no stream ran."""
        stream, self.active_stream = self.active_stream, None
        return None if stream is None else stream.close(reason)

    # ------------------------------------------------------------------ multi-turn barrier batch
    def run(self, requests: list[dict[str, Any]]) -> list[Trajectory]:
        """Every request's trajectory, finished (in request order); only returns once all are done."""
        if self.make_env is None or self.tokenizer is None or self.max_context_tokens <= 0:
            raise RuntimeError("run() drives multi-turn trajectories: build the RolloutManager with make_env, "
                               "tokenizer and max_context_tokens")
        if self.active_stream is not None:
            raise RuntimeError("this RolloutManager is in stream mode: take() the stream's batches instead")
        waiting = list(requests)
        open_: list[Trajectory] = []
        done: dict[str, Trajectory] = {}
        ready: list[Trajectory] = []  # waiting for their next assistant turn
        calls: dict[cf.Future, list[Trajectory]] = {}
        steps: dict[cf.Future, Trajectory] = {}
        while waiting or open_:
            while waiting and len(open_) < self.max_open:
                traj = self._start(waiting.pop(0))
                open_.append(traj)
                if traj.finish:
                    self._finish(traj, open_, done)
                else:
                    ready.append(traj)
            self.peak_open = max(self.peak_open, len(open_))
            while ready and len(calls) < self.max_calls:
                batch, ready = ready[: self.per_call], ready[self.per_call :]
                future = self._engine_pool.submit(self.engine.generate, [self._turn_request(t) for t in batch])
                calls[future] = batch
                self._track(future)
            self.peak_calls = max(self.peak_calls, len(calls))
            pending = set(calls) | set(steps)
            now = time.monotonic()
            wake = min((t.deadline for t in open_), default=now + 1.0)
            finished, _ = cf.wait(pending, timeout=max(0.01, min(wake - now, 5.0)), return_when=cf.FIRST_COMPLETED)
            for future in finished:
                if future in calls:
                    self._on_turns(calls.pop(future), future, steps)
                else:
                    self._on_step(steps.pop(future), future, ready)
            now = time.monotonic()
            for traj in list(open_):
                if traj.finish or (not traj.failure and now > traj.deadline):
                    if not traj.finish:
                        self._fail(traj, f"timed out: the trajectory ran past trajectory_timeout_s="
                                         f"{self.cfg.trajectory_timeout_s:g}s")
                    self._finish(traj, open_, done)
            ready = [t for t in ready if not t.finish]
        return [done[r["sample_id"]] for r in requests]

    def quiesce(self, timeout_s: float | None = None) -> None:
        """Before a weight sync: wait until no engine call of a barrier batch is in flight; ``TimeoutError`` past
        ``timeout_s``. (Stream mode: see the module docstring.)"""
        timeout_s = float(self.engine.cfg.timeout_s) if timeout_s is None else timeout_s
        with self._calls_lock:
            in_flight = list(self._engine_calls)
        _, still = cf.wait(in_flight, timeout=timeout_s)
        if still:
            raise TimeoutError(f"{len(still)} engine call(s) still in flight after {timeout_s:.0f}s; "
                               "the weights are not synced while the engine samples")

    def _track(self, future: cf.Future) -> None:
        with self._calls_lock:
            self._engine_calls.add(future)
        future.add_done_callback(self._call_done)

    def _call_done(self, future: cf.Future) -> None:
        with self._calls_lock:
            self._engine_calls.discard(future)

    def shutdown(self, reason: str = "the trainer stopped") -> None:
        try:
            self.close_stream(reason)
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.warning("closing the rollout stream: %s", exc)
        self._engine_pool.shutdown(wait=False, cancel_futures=True)
        self._tool_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ state machine
    def _start(self, request: dict[str, Any]) -> Trajectory:
        env = self.make_env()
        row = {"prompt": request["prompt"], **(request.get("columns") or {})}
        traj = None
        try:
            messages = env.reset(row)
            transcript = TokenTranscript(self.tokenizer, messages, tools=env.tools or None)
        except Exception as exc:  # noqa: BLE001 - a broken environment / template fails this trajectory only
            transcript = _EmptyTranscript()
            traj = Trajectory(request=request, env=env, transcript=transcript)  # type: ignore[arg-type]
            self._fail(traj, f"environment reset failed: {type(exc).__name__}: {exc}")
            return traj
        traj = Trajectory(request=request, env=env, transcript=transcript,
                          deadline=time.monotonic() + self.cfg.trajectory_timeout_s, seconds=time.monotonic())
        if len(transcript.ids) > self.max_context_tokens:
            self._fail(traj, f"the prompt is {len(transcript.ids)} tokens, over pipeline.max_prompt_tokens="
                             f"{self.max_context_tokens} (the longest context a turn may see)")
        return traj

    def _turn_request(self, traj: Trajectory) -> dict[str, Any]:
        r = traj.request
        return {"sample_id": f"{r['sample_id']}/t{traj.turns}", "group_id": r["group_id"], "prompt": r["prompt"],
                "prompt_ids": list(traj.transcript.ids), "seed": self.turn_seed(r["seed"], traj.turns)}

    def _on_turns(self, batch: list[Trajectory], future: cf.Future, steps: dict[cf.Future, Trajectory]) -> None:
        try:
            samples = future.result()
        except Exception as exc:  # noqa: BLE001 - the engine's retries are spent: these trajectories fail
            for traj in batch:
                if not traj.finish:
                    self._fail(traj, f"engine error: {exc}")
            return
        if [s.sample_id for s in samples] != [f"{t.request['sample_id']}/t{t.turns}" for t in batch]:
            raise RuntimeError("the engine answered an agent's turns out of order or incompletely")
        for traj, sample in zip(batch, samples):
            if traj.finish:  # timed out while its turn was sampled
                continue
            part = sample.parts[0]
            text = traj.transcript.add_assistant(part.completion_ids.tolist(), part.log_probs.tolist())
            traj.versions.append(int(sample.policy_version))
            traj.texts.append(text)
            steps[self._tool_pool.submit(traj.env.step, text)] = traj

    def _on_step(self, traj: Trajectory, future: cf.Future, ready: list[Trajectory]) -> None:
        if traj.finish:
            return
        try:
            observation, reward, finished = future.result()
        except Exception as exc:  # noqa: BLE001 - a crashed / hung tool fails its trajectory, with the reason
            self._fail(traj, f"{type(exc).__name__}: {exc}")
            return
        traj.turn_rewards.append(None if reward is None else float(reward))
        if finished or not observation:
            traj.finish = str(getattr(traj.env, "finish_reason", None) or "done")
            return
        try:
            traj.transcript.add_observation(observation)
        except (ValueError, TypeError, KeyError) as exc:  # messages the chat template cannot render
            self._fail(traj, f"the observation cannot be rendered: {type(exc).__name__}: {exc}")
            return
        if len(traj.transcript.ids) > self.max_context_tokens:
            traj.finish = "context_full"
            return
        ready.append(traj)

    def _fail(self, traj: Trajectory, reason: str) -> None:
        traj.failure, traj.finish = reason, "failed"
        log.info("trajectory %s failed: %s", traj.request.get("sample_id"), reason)

    def _finish(self, traj: Trajectory, open_: list[Trajectory], done: dict[str, Trajectory]) -> None:
        open_.remove(traj)
        traj.seconds = time.monotonic() - traj.seconds if traj.seconds else 0.0
        if traj.failure is None:
            try:
                traj.answer = str(traj.env.answer())
            except Exception as exc:  # noqa: BLE001
                self._fail(traj, f"environment answer failed: {type(exc).__name__}: {exc}")
        if self.cfg.strict_check and traj.turns and traj.failure is None:
            traj.retokenize_mismatch = traj.transcript.retokenize_mismatch()
        if traj.turns:
            traj.transcript.check()  # one mask / log-prob per id, mask 1 exactly on the sampled turns
        close = getattr(traj.env, "close", None)
        if callable(close):
            try:
                close()  # its tools' processes (the Python tool's session) end with the trajectory
            except Exception as exc:  # noqa: BLE001 - nothing of the result depends on it
                log.warning("closing the environment of trajectory %s failed: %s", traj.request.get("sample_id"), exc)
        done[traj.request["sample_id"]] = traj


class _EmptyTranscript:
    """The transcript of a trajectory whose environment failed before its first message."""

    ids: list[int] = []
    turns: list[Any] = []
    messages: list[dict[str, Any]] = []
    loss_mask: list[int] = []
    prompt_length = 0


def agent_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """``agent/*`` metrics of a step's trajectories (turns, tools, failures, masks, re-tokenisation)."""
    n = max(len(trajectories), 1)
    turns = [t.turns for t in trajectories]
    stats = [t.env.stats() for t in trajectories]
    calls = sum(s.get("tool_calls", 0.0) for s in stats)
    errors = sum(s.get("tool_errors", 0.0) for s in stats)
    seconds = sum(s.get("tool_seconds", 0.0) for s in stats)
    after_prompt = sum(len(t.transcript.ids) - t.transcript.prompt_length for t in trajectories if t.turns)
    sampled = sum(sum(t.transcript.loss_mask) for t in trajectories if t.turns)
    checked = [t.retokenize_mismatch for t in trajectories if t.retokenize_mismatch is not None]
    out = {
        "agent/turns_mean": sum(turns) / n,
        "agent/turns_max": float(max(turns, default=0)),
        "agent/tool_calls_per_traj": calls / n,
        "agent/tool_error_rate": errors / calls if calls else 0.0,
        "agent/tool_latency_s": seconds / calls if calls else 0.0,
        "agent/failed": float(sum(t.failure is not None for t in trajectories)),
        "agent/failed_frac": sum(t.failure is not None for t in trajectories) / n,
        "agent/masked_token_frac": 1.0 - sampled / after_prompt if after_prompt else 0.0,
        "agent/context_tokens_max": float(max((len(t.transcript.ids) for t in trajectories), default=0)),
        "agent/seconds_mean": sum(t.seconds for t in trajectories) / n,
    }
    if checked:
        out["agent/retokenize_mismatch_frac"] = sum(checked) / len(checked)
    for reason in sorted({"answer", "max_turns", "context_full", "failed", *(t.finish for t in trajectories)}):
        out[f"agent/finish_{reason}_frac"] = sum(t.finish == reason for t in trajectories) / n
    return out
