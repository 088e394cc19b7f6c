"""Helpers the benchmarks share: offline environment, timing statistics, CPU accounting, driving a real
trainer step by step in interleaved blocks, report plumbing (number cells, plain-text tables, the JSON
result line)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}


def offline_env() -> None:
    """No hub downloads, telemetry or tokenizer threads (set before torch / transformers / ray load)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a ``torch.distributed`` rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_setup(trainer: Any) -> float:
    """``trainer.setup()`` for a new run (its resolved-recipe dump shown only if setup fails); seconds taken.

    Raises if the run resumed an earlier one: a benchmark must start from step 0.
    """
    t0 = time.perf_counter()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            resumed = trainer.setup()
    except BaseException:
        sys.stdout.write(captured.getvalue())
        raise
    if resumed:
        raise RuntimeError("the benchmark needs a fresh run, but it resumed an earlier one")
    return time.perf_counter() - t0


def median(values: list[float]) -> float:
    """Median of the finite values (NaN when there are none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(statistics.median(values)) if values else float("nan")


def cpu_seconds() -> tuple[float, float]:
    """(this process, its child processes: the embedded Ray cluster) user+system CPU seconds so far."""
    own, by_pid = _cpu_by_process()
    return own, sum(cpu for _, cpu in by_pid.values())


def _cpu_by_process() -> tuple[float, dict[int, tuple[str, float]]]:
    """This process's user+system CPU seconds so far, and each child process's (recursive: the embedded Ray's
    daemons, workers and actors) as ``{pid: (kind, seconds)}``, its kind from its title (``process_cpu.kind``)."""
    try:
        import psutil
    except ImportError:
        return float("nan"), {}
    from process_cpu import kind

    me = psutil.Process()
    own = me.cpu_times()
    children: dict[int, tuple[str, float]] = {}
    for proc in me.children(recursive=True):
        try:
            t = proc.cpu_times()
            children[proc.pid] = (kind(" ".join(proc.cmdline())), t.user + t.system)
        except psutil.Error:
            pass
    return own.user + own.system, children


def cpu_by_kind(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each kind of child process used between two ``_cpu_by_process`` samples (a process that started
    in between counts from zero; one that ended in between is missed)."""
    used: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        used[name] = used.get(name, 0.0) + cpu - (before[pid][1] if pid in before else 0.0)
    return used


# ---------------------------------------------------------------------------------------------
# driving a real trainer step by step, and sides in interleaved blocks


StepRecord = Callable[[int, dict[str, Any], dict[str, float]], dict[str, Any]]
"""``(step, metrics, times) -> record``: what a ``DrivenTrainer`` keeps of one step (``times``: see there)."""


def pick(keys: tuple[str, ...]) -> StepRecord:
    """A ``StepRecord`` keeping ``keys`` of the metrics as floats (NaN for a key the step did not report)."""
    return lambda step, metrics, times: {k: float(metrics.get(k, float("nan"))) for k in keys}


class DrivenTrainer:
    """A real trainer driven step by step, in blocks, as its ``run_steps`` drives it.

    ``setup()``: ``fresh_setup`` (seconds). ``run_block(n)``: the next ``n`` steps, each ``run_step(i)``
    (with ``per_call``: ``train_steps(first, count)``, up to ``per_call`` steps per command, the SFT
    trainer's way), its metrics logged to the trainer's tracker and, with ``checkpoint_steps`` (the
    run's step budget), a checkpoint every ``run_cfg.checkpoint_every`` steps and at that last step;
    ``steps[i]`` is then ``on_step(i, metrics, times)`` (default: the metrics), where ``times`` holds
    ``log_s`` (the tracker call), ``checkpoint_s`` (NaN without one), ``wall_s`` (since the end of
    the previous step of the block, or its start) and ``end_time`` (``time.time()`` at the step's
    end); returns the block's wall seconds. ``close()``: ``teardown(status)``, status ``FAILED``
    unless ``finish()`` was called (with ``quiet_teardown``, its "MLflow run ..." lines are hidden);
    sets ``teardown_s``.
    """

    def __init__(self, trainer: Any, *, on_step: StepRecord | None = None, checkpoint_steps: int | None = None,
                 per_call: int | None = None, quiet_teardown: bool = False) -> None:
        self.trainer = trainer
        self.on_step = on_step or (lambda step, metrics, times: dict(metrics))
        self.checkpoint_steps = checkpoint_steps
        self.per_call = per_call
        self.quiet_teardown = quiet_teardown
        self.done = 0
        self.status = "FAILED"
        self.steps: dict[int, dict[str, Any]] = {}
        self.teardown_s = float("nan")

    def setup(self) -> float:
        return fresh_setup(self.trainer)

    def _metrics(self, first: int, n: int) -> Iterator[tuple[int, dict[str, Any]]]:
        if self.per_call is None:
            for i in range(first, first + n):
                yield i, self.trainer.run_step(i)
            return
        done = 0
        while done < n:
            count = min(n - done, self.per_call)
            for j, metrics in enumerate(self.trainer.train_steps(first + done, count)):
                yield first + done + j, metrics
            done += count

    def run_block(self, n: int) -> float:
        tr = self.trainer
        t0 = t_prev = time.perf_counter()
        for i, metrics in self._metrics(self.done + 1, n):
            t_log = time.perf_counter()
            tr.tracker.log_metrics(metrics, step=i)
            log_s = time.perf_counter() - t_log
            checkpoint_s = float("nan")
            last = self.checkpoint_steps
            if last is not None and (i % tr.run_cfg.checkpoint_every == 0 or i == last):
                t_ckpt = time.perf_counter()
                tr.save_checkpoint(i)
                checkpoint_s = time.perf_counter() - t_ckpt
            now = time.perf_counter()
            times = {"log_s": log_s, "checkpoint_s": checkpoint_s, "wall_s": now - t_prev, "end_time": time.time()}
            t_prev = now
            self.steps[i] = self.on_step(i, metrics, times)
        self.done += n
        return time.perf_counter() - t0

    def series(self, key: str, steps: list[int]) -> list[Any]:
        """``steps[s][key]`` for each of ``steps``."""
        return [self.steps[s][key] for s in steps]

    def prompts_of(self, step: int) -> list[str] | None:
        """The prompts the trainer drew for ``step`` (an RL trainer's ``prompt_log``), None if none."""
        for s, prompts in self.trainer.prompt_log:
            if s == step:
                return prompts
        return None

    def finish(self) -> None:
        """Every planned step ran: ``close()`` will end the run as FINISHED."""
        self.status = "FINISHED"

    def close(self) -> None:
        t0 = time.perf_counter()
        quiet = contextlib.redirect_stdout(io.StringIO()) if self.quiet_teardown else contextlib.nullcontext()
        with quiet:
            self.trainer.teardown(self.status)
        self.teardown_s = time.perf_counter() - t0


def close_all(runners: dict[str, Any]) -> None:
    """``close()`` every runner in the order given; a failed one is printed and the others still close."""
    for name, runner in runners.items():
        try:
            runner.close()
        except Exception as exc:  # noqa: BLE001 - keep tearing down the others
            print(f"[bench] teardown of {name} failed: {exc}", flush=True)


class Interleave:
    """Sides run in interleaved blocks. ``run(side, n, block, measured=...)`` calls ``block(n)`` (which
    runs ``n`` steps of the side and returns their wall seconds) and records the order (``order``:
    ``"A4"``-style labels) and, for a measured block, its wall seconds per step (``walls[side]``) and
    the (this process, its child processes) CPU seconds per step (``cpu[side]``, see ``cpu_seconds``)."""

    def __init__(self, sides) -> None:
        self.order: list[str] = []
        self.walls: dict[str, list[float]] = {s: [] for s in sides}
        self.cpu: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
        self.cpu_kinds: dict[str, list[dict[str, float]]] = {s: [] for s in sides}

    def run(self, side: str, n: int, block: Callable[[int], float], *, measured: bool) -> float:
        own0, kids0 = _cpu_by_process()
        wall = block(n)
        own1, kids1 = _cpu_by_process()
        self.order.append(f"{side}{n}")
        if measured:
            kinds = cpu_by_kind(kids0, kids1)
            self.walls[side].append(wall / n)
            self.cpu[side].append(((own1 - own0) / n, sum(kinds.values()) / n))
            self.cpu_kinds[side].append({name: cpu / n for name, cpu in kinds.items()})
        return wall

    def cpu_median(self, side: str) -> tuple[float, float]:
        """Block medians of the (this process, child processes) CPU seconds per step."""
        return median([c[0] for c in self.cpu[side]]), median([c[1] for c in self.cpu[side]])

    def cpu_kinds_median(self, side: str) -> dict[str, float]:
        """Block medians of each kind of child process's CPU seconds per step (``process_cpu.kind``)."""
        names = {name for block in self.cpu_kinds[side] for name in block}
        return {name: median([block.get(name, 0.0) for block in self.cpu_kinds[side]]) for name in sorted(names)}


def trl_available() -> tuple[bool, str]:
    """(whether TRL and datasets import, a note for the report: TRL's version or how to install it)."""
    try:
        import datasets  # noqa: F401
        import trl
    except ImportError as exc:
        return False, f"TRL is not installed ({exc}); `pip install -e .[bench]` (trl>=1.16,<2) adds it"
    return True, f"trl {trl.__version__}"


class StopGated(Exception):
    """Raised inside a gated training loop (by ``StepGate.on_step_begin``) to end it after the last block."""


class StepGate:
    """Holds a training loop running in a thread (TRL's ``train()``) at the start of every step until the
    driver releases it. Mix it into a ``transformers.TrainerCallback`` (``class Gate(StepGate,
    TrainerCallback)``): ``on_step_begin`` is the hook. ``begin_t[k]``: when step ``k`` reached the gate;
    ``release_t[k]``: when it went on (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.allowed = self.begun = 0
        self.stop = False
        self.begin_t: dict[int, float] = {}
        self.release_t: dict[int, float] = {}

    def on_step_begin(self, args: Any = None, state: Any = None, control: Any = None, **kwargs: Any) -> None:
        now = time.perf_counter()
        with self.cv:
            self.begun += 1
            k = self.begun
            self.begin_t[k] = now
            self.cv.notify_all()
            while self.allowed < k and not self.stop:
                self.cv.wait()
            if self.stop:
                raise StopGated()
        self.release_t[k] = time.perf_counter()


class GatedLoop:
    """A blocking training loop ``train()``, gated by ``gate``, in a daemon thread named ``name``.

    ``start()`` runs it up to the gate of its first step (seconds taken); ``release(n)`` lets ``n`` more
    steps run and waits until the loop holds at the next one (seconds taken); ``step_s(k)``: step ``k``
    from its release to the start of step ``k + 1`` (one whole iteration of the loop); ``close()`` ends
    the loop at its gate. An error in the loop is raised in the driver by the next wait.
    """

    def __init__(self, train: Callable[[], Any], gate: StepGate, name: str) -> None:
        self.train, self.gate, self.name = train, gate, name
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            self.train()
        except StopGated:
            pass
        except BaseException as exc:  # surfaced in the driver by _wait
            self.error = exc
        finally:
            with self.gate.cv:
                self.gate.cv.notify_all()

    def _wait(self, k: int, timeout_s: float = 1800.0) -> None:
        deadline = time.monotonic() + timeout_s
        with self.gate.cv:
            while self.gate.begun < k:
                if self.error is not None or (self.thread is not None and not self.thread.is_alive()):
                    raise RuntimeError(f"{self.name}: train() ended before step {k}") from self.error
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: train() did not reach step {k} within {timeout_s:.0f}s")
                self.gate.cv.wait(timeout=1.0)

    def start(self) -> float:
        t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.thread.start()
        self._wait(1)
        return time.perf_counter() - t0

    def release(self, n: int) -> float:
        t0 = time.perf_counter()
        with self.gate.cv:
            self.gate.allowed += n
            target = self.gate.allowed + 1
            self.gate.cv.notify_all()
        self._wait(target)
        return time.perf_counter() - t0

    def step_s(self, k: int) -> float:
        return self.gate.begin_t[k + 1] - self.gate.release_t[k]

    def close(self) -> None:
        with self.gate.cv:
            self.gate.stop = True
            self.gate.cv.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=60)


# ---------------------------------------------------------------------------------------------
# report plumbing: number cells, tables, the JSON result line


def fmt_num(x: float | None, width: int = 7, digits: int = 3, *, unit: str = "", missing: str = "-") -> str:
    """``x`` right-aligned in ``width`` characters with ``digits`` decimals and ``unit`` appended;
    ``missing`` (right-aligned in ``width + len(unit)``) when ``x`` is None or not finite."""
    if x is None or not math.isfinite(x):
        return f"{missing:>{width + len(unit)}}"
    return f"{x:{width}.{digits}f}{unit}"


def table_lines(header: list[str], rows: list[list[str]], widths: list[int], *, gap: int = 1) -> list[str]:
    """A plain-text table: the first column left-aligned to its width, the others right-aligned,
    columns separated by ``gap`` spaces. Cells are strings (format numbers with ``fmt_num``)."""
    if any(len(row) != len(widths) for row in [header, *rows]):
        raise ValueError(f"every row needs {len(widths)} cells (one per width)")
    sep = " " * gap

    def line(cells: list[str]) -> str:
        return sep.join([f"{cells[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:]))])

    return [line(header), *(line(row) for row in rows)]


def print_table(header: list[str], rows: list[list[str]], widths: list[int], *, gap: int = 1) -> None:
    """Print ``table_lines``."""
    for text in table_lines(header, rows, widths, gap=gap):
        print(text)


def emit_json(result: dict, json_out: str | None, *, sort_keys: bool = True) -> str:
    """Print the result as one JSON line (flushed) and, when ``json_out`` is set, write it there too."""
    line = json.dumps(result, sort_keys=sort_keys)
    print(line, flush=True)
    if json_out:
        Path(json_out).write_text(line + "\n", encoding="utf-8")
    return line


def loadavg_1min() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


def shutdown_ray() -> None:
    """Shut down Serve and the bench's Ray (best effort)."""
    import ray

    if ray.is_initialized():
        try:
            from ray import serve

            serve.shutdown()
        except Exception:  # noqa: BLE001 - best effort, ray.shutdown ends everything
            pass
        ray.shutdown()


def finish_report(result: dict[str, Any], load_start: float, t_all: float, json_out: str | None) -> None:
    """Print the load / wall-time line, add them and the host to ``result``, emit the JSON line."""
    import platform

    import torch

    load_end = loadavg_1min()
    print(f"1-min load average: {load_start:.1f} at start, {load_end:.1f} at end ({os.cpu_count()} CPUs); "
          f"total {time.perf_counter() - t_all:.0f} s")
    result |= {"total_wall_s": time.perf_counter() - t_all, "loadavg_1min": {"start": load_start, "end": load_end},
               "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}}
    emit_json(result, json_out)


def moving_average(curve: list[float], window: int) -> list[float]:
    """``out[i]`` = mean of ``curve[i - window + 1 .. i]`` (NaN for the first ``window - 1`` steps)."""
    return [float("nan") if i + 1 < window else float(statistics.fmean(curve[i + 1 - window:i + 1])) for i in range(len(curve))]


def steps_to_threshold(curve: list[float], window: int, delta: float) -> tuple[float, int | None]:
    """(start, first step) where start = mean of the first ``window`` steps and the first step (1-based,
    after the first window) whose ``window``-step moving average is >= start + ``delta``; None if never."""
    start = float(statistics.fmean(curve[:window]))
    ma = moving_average(curve, window)
    for i in range(window, len(curve)):
        if ma[i] >= start + delta:
            return start, i + 1
    return start, None
