"""A warm fit: ``fit()`` of a short run on a local Ray that is already up, by Ray Train poll interval.

A benchmark, not a test: it asserts nothing about speed. What a notebook user pays for every run after
the first, and what every end-to-end test pays: the Ray Train controller and its workers start, the
worker builds its model, two steps train, the last checkpoint commits, the run ends. Ray Train's
controller advances a run once per poll of its workers (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by
default; ``unirl_ray.runtime.cluster.EMBEDDED_RAY_ENV`` sets 0.5 s for an embedded Ray).

Each setting runs in its own child process (a new local Ray: the controller reads the interval when it
starts), settings alternating so that a drift of the machine's speed hits them alike; the first fit of
each process (a cold one: Ray's own start, the first imports) is reported apart.

    python bench/warm_fit.py                          # 0.5 s against 2.0 s, 3 warm fits x 2 rounds each (~3 min on 2 cores)
    python bench/warm_fit.py --intervals 0.1 0.5 2.0 --rounds 3 --json-out /tmp/warm.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import finish_report, loadavg_1min, median, offline_env, print_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {repo!r})
from unirl_ray.config.recipe import load_recipe
from unirl_ray.runtime.cluster import RayConfig, ensure_ray
from unirl_ray.trainer.ar import ARTrainer

ensure_ray(RayConfig(local_num_cpus=8))  # started as a notebook's first fit starts it (an embedded Ray)
times = []
for i in range({fits}):
    cfg = load_recipe(os.path.join({repo!r}, "recipes", "ar", "tiny", "char_grpo_direct.yaml"), [
        f"trainer.run_name=warm-{{i}}", f"trainer.storage_path={storage!r}", "trainer.num_steps=2",
        "trainer.checkpoint_every=100", "tracking.log_samples_every=0", "ray.scaling.num_workers=1",
        "ray.scaling.resources_per_worker.CPU=2"])
    trainer = ARTrainer(cfg)
    t0 = time.perf_counter()
    trainer.fit()
    times.append(time.perf_counter() - t0)
print("WARM_FIT " + json.dumps(times), flush=True)
"""


def run_setting(interval: float, fits: int, timeout_s: float) -> list[float]:
    """``fits`` fits in a new process with the given poll interval; their wall seconds (the first is cold)."""
    with tempfile.TemporaryDirectory(prefix="warm_fit_") as storage:
        env = {**os.environ, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(interval)}
        code = CHILD.format(repo=str(REPO), fits=fits, storage=storage)
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith("WARM_FIT "):
            return json.loads(line[len("WARM_FIT "):])
    raise RuntimeError(f"the child (interval {interval}) printed no times (exit {proc.returncode}):\n"
                       f"{(proc.stdout + proc.stderr)[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--fits", type=int, default=4, help="fits per process, the first of them cold")
    parser.add_argument("--rounds", type=int, default=2, help="processes per interval, interleaved")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    offline_env()
    load_start, t_all = loadavg_1min(), time.perf_counter()
    cold: dict[float, list[float]] = {i: [] for i in args.intervals}
    warm: dict[float, list[float]] = {i: [] for i in args.intervals}
    for r in range(args.rounds):
        for interval in args.intervals:
            times = run_setting(interval, args.fits, args.timeout_s)
            cold[interval].append(times[0])
            warm[interval] += times[1:]
            print(f"round {r + 1}, interval {interval} s: " + ", ".join(f"{t:.2f}" for t in times), flush=True)
    base = args.intervals[-1]
    rows = [[f"{i:g}", f"{median(warm[i]):.2f}", f"{min(warm[i]):.2f}-{max(warm[i]):.2f}",
             f"{median(warm[i]) / median(warm[base]):.2f}", f"{median(cold[i]):.2f}"] for i in args.intervals]
    print_table(["poll interval s", "warm fit s (median)", "range", f"ratio to {base:g} s", "first fit s"], rows,
                [16, 20, 12, 14, 12])
    result = {"bench": "warm_fit", "fits_per_process": args.fits, "rounds": args.rounds,
              "warm_s": {str(i): warm[i] for i in args.intervals}, "first_fit_s": {str(i): cold[i] for i in args.intervals}}
    finish_report(result, load_start, t_all, args.json_out)


if __name__ == "__main__":
    main()
