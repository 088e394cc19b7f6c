"""Helpers the benchmarks share: offline environment, timing statistics, CPU accounting, report plumbing
(number cells, plain-text tables, the JSON result line)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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
    try:
        import psutil
    except ImportError:
        return float("nan"), float("nan")
    me = psutil.Process()
    own = me.cpu_times()
    children = 0.0
    for proc in me.children(recursive=True):
        try:
            t = proc.cpu_times()
            children += t.user + t.system
        except psutil.Error:
            pass
    return own.user + own.system, children


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
