"""Helpers the benchmarks share (timing statistics, CPU accounting)."""

from __future__ import annotations

import math
import os
import statistics

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
