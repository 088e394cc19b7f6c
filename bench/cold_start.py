"""Cold start: from the command to the first finished step, for the tiny SD3, AR and SFT recipes, by phase.

A benchmark, not a test: it asserts nothing about speed. Each run is the command a user types,
``python recipes/<domain>.py trainer.num_steps=1`` on the recipe's embedded defaults (a new local Ray,
a new MLflow SQLite store in a fresh storage folder), run as a child process. The trainer prints its
start-up milestones after the first step (``unirl_ray.runtime.startup``: seconds since the process
started, the same numbers it logs to MLflow as ``startup/*_s``); this script reads that line:

  setup       the driver's imports and recipe checks are done (``setup()`` entered)
  ray         Ray started
  reward_app  the reward Serve app is ready (it deploys in the background while the workers start)
  workers     every train rank built its model and announced
  services    rewards / engines awaited (on the critical path only when they were later than the workers)
  tracking    the MLflow run open
  first_step  the first step trained and logged

Side by side (``--trl``, needs ``pip install -e .[bench]``): TRL's ``GRPOTrainer`` on the same tiny AR task
(``bench/ar_grpo_vs_trl.py``'s TRL side: same model, prompts and GRPO settings), its time from its
process start to the end of its first step, also in a child process.

    python bench/cold_start.py                    # sd3, ar, sft; 2 runs each (~4-5 min on 2 cores)
    python bench/cold_start.py --recipes ar --trl --repeats 3 --json-out /tmp/cold.json

Medians over the runs; see bench/README.md for the figures and what they say.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import finish_report, fmt_num, loadavg_1min, median, offline_env, print_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"sd3": "recipes/sd3.py", "ar": "recipes/ar.py", "sft": "recipes/sft.py"}
PHASES = ("setup", "ray", "reward_app", "workers", "services", "tracking", "first_step")
LINE = re.compile(r"first step ([\d.]+)s after the process started \(seconds: (.*)\)")


def parse_startup(output: str) -> dict[str, float]:
    """The milestones of the trainer's start-up line (``{}`` if it printed none)."""
    match = LINE.search(output)
    if not match:
        return {}
    return {name: float(value) for name, value in (part.rsplit(" ", 1) for part in match.group(2).split(" | "))}


def run_recipe(domain: str, storage: str, index: int, timeout_s: float) -> dict[str, float]:
    """One cold run of ``domain``'s tiny recipe; its milestones plus ``command_s`` (the whole command)."""
    env = {**os.environ, "UNIRL_STORAGE_PATH": storage}
    cmd = [sys.executable, str(REPO / RECIPES[domain]), "trainer.num_steps=1", f"trainer.run_name=cold-{domain}-{index}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    total = time.time() - t0
    marks = parse_startup(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not marks:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"{domain} run {index} failed (exit {proc.returncode}) or printed no start-up line:\n{tail}")
    return {**marks, "command_s": total}


def trl_child() -> None:
    """In a fresh process: TRL's GRPOTrainer on the tiny AR task, one step; prints the seconds from the
    process start to the end of that step."""
    from unirl_ray.runtime.startup import process_start_time

    start = process_start_time()
    sys.argv = [sys.argv[0]]
    # TRL imports vLLM whenever it is installed (~15 s here with the CPU build), though this run generates
    # with HF generate; the trainer's direct recipe never imports it either. Hidden, as in a venv without it.
    sys.modules["vllm"] = None  # importlib.util.find_spec("vllm") is then None
    import ar_grpo_vs_trl as side_by_side

    from unirl_ray.config.recipe import load_recipe

    recipe = load_recipe(str(side_by_side.DEFAULT_DIRECT), [])
    task = side_by_side.Task(recipe)
    with tempfile.TemporaryDirectory() as out:
        trl = side_by_side.TRLSide(recipe, task, side_by_side.prompt_schedule(recipe, 1), 1, out)
        ready = time.time() - start
        trl.setup()
        trl.run_block(1)
        done = time.time() - start
        trl.close()
    print(f"TRL_FIRST_STEP {ready:.3f} {done:.3f}", flush=True)


def run_trl(timeout_s: float) -> dict[str, float]:
    proc = subprocess.run([sys.executable, __file__, "--trl-child"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s)
    match = re.search(r"TRL_FIRST_STEP ([\d.]+) ([\d.]+)", proc.stdout)
    if not match:
        raise SystemExit(f"the TRL side failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return {"trainer_built": float(match.group(1)), "first_step": float(match.group(2))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", default="sd3,ar,sft", help="comma-separated, of: " + ", ".join(RECIPES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trl", action="store_true", help="also TRL's time to its first step (tiny AR task)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--json-out")
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    offline_env()
    if args.trl_child:
        trl_child()
        return 0
    domains = [d.strip() for d in args.recipes.split(",") if d.strip()]
    unknown = [d for d in domains if d not in RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {sorted(RECIPES)}")
    load_start, t_all = loadavg_1min(), time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in domains}
    trl_runs: list[dict[str, float]] = []
    for i in range(args.repeats):  # interleaved: a load change hits every side alike
        for domain in domains:
            with tempfile.TemporaryDirectory(prefix=f"cold_{domain}_") as storage:
                runs[domain].append(run_recipe(domain, storage, i, args.timeout_s))
            print(f"{domain} run {i + 1}: first step at {runs[domain][-1]['first_step']:.1f}s", flush=True)
        if args.trl:
            trl_runs.append(run_trl(args.timeout_s))
            print(f"trl run {i + 1}: first step at {trl_runs[-1]['first_step']:.1f}s", flush=True)

    header = ["recipe", *PHASES, "command", "spread"]
    rows, result = [], {"runs": runs, "trl": trl_runs, "medians": {}}
    for domain, items in runs.items():
        med = {k: median([r[k] for r in items if k in r]) for k in (*PHASES, "command_s") if any(k in r for r in items)}
        firsts = [r["first_step"] for r in items]
        result["medians"][domain] = med
        rows.append([domain, *(fmt_num(med.get(p), 6, 1) for p in PHASES), fmt_num(med["command_s"], 7, 1),
                     f"{min(firsts):.1f}-{max(firsts):.1f}"])
    if trl_runs:
        med = {k: median([r[k] for r in trl_runs]) for k in ("trainer_built", "first_step")}
        result["medians"]["trl"] = med
        firsts = [r["first_step"] for r in trl_runs]
        rows.append(["trl (ar)", fmt_num(med["trainer_built"], 6, 1), *["-"] * 5, fmt_num(med["first_step"], 6, 1),
                     "-", f"{min(firsts):.1f}-{max(firsts):.1f}"])
    print(f"\nmedian seconds since the process started, over {args.repeats} cold runs each "
          "(trl: 'setup' = its GRPOTrainer built)")
    print_table(header, rows, [9, *[10] * len(PHASES), 8, 10])
    finish_report(result, load_start, t_all, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
