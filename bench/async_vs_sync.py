"""Async RL (max_staleness 1 and 2) vs the synchronous trainer on the same tiny tasks: throughput
(samples/s) and steps to a reward threshold, side by side.

A benchmark, not a test: it asserts nothing about speed or learning. Three sides per task, on the same
recipe (the same dedicated rollout engine with ``placement: separate``, the same resources, the same
algorithm with its off-policy correction, the same prompts and per-sample seeds):

  sync     ``ARTrainer`` / ``DiffusionTrainer`` on the async recipe with its ``async_rollout`` section
           deleted: rollout, reward, train and weight sync one after the other, every step;
  async-1  ``AsyncARTrainer`` / ``AsyncDiffusionTrainer`` with ``async_rollout.max_staleness=1``: the
           rollout slab (engine app fed by a Ray Data stream) generates the next batches while the
           train slab trains;
  async-2  the same with ``max_staleness=2``.

So the only difference is the overlap of rollout and training (and, for async, samples up to
``max_staleness`` versions old, corrected by the recipe's ``algorithm.off_policy``).

Tasks: ``ar`` (``recipes/ar/tiny/char_grpo_async.yaml``: tiny char LM, reward = fraction of "a") and
``diffusion`` (``recipes/diffusion/sd3/sd3_tiny_flowgrpo_async.yaml``: tiny SD3 + LoRA, brightness).
Every run is a real trainer in one embedded local Ray cluster (``ray.init(num_cpus=8)``, a fresh
temporary storage path): ``setup()``, then ``--steps`` calls of ``run_step(i)`` (metrics logged to
MLflow), then ``teardown()``. Runs go one at a time (an async trainer's rollout slab keeps running
between calls, so sides cannot share the machine in blocks), after one short unmeasured warm-up run
(``--warmup-runs 0`` skips it), ordered seed by seed: sync, async-1, async-2, sync, ...

Throughput: samples trained / wall time of steps 3..N (the first 2 steps are warm-up; setup and
teardown are excluded), also the median of the per-step wall times and of ``timing/step`` and the
async metrics. Steps to threshold: the first step whose 3-step moving average of ``reward/mean``
reaches start + delta (start = mean of steps 1-3).

    python bench/async_vs_sync.py                                  # both tasks, 2 seeds, ~15 min on 2 cores
    python bench/async_vs_sync.py --task ar --steps 24 --seeds 0,1
    python bench/async_vs_sync.py --task diffusion --steps 16 --delta-diffusion 0.01 --json-out /tmp/async.json
    python bench/async_vs_sync.py --reanalyse /tmp/async.json --delta-diffusion 0.02   # other thresholds, no rerun

See bench/README.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402  (bench/ is on sys.path when run as a script)
    DrivenTrainer, pick,
    moving_average, steps_to_threshold,
    finish_report, shutdown_ray,
    cpu_seconds, emit_json, fmt_num, loadavg_1min, median, offline_env, print_table,
)

offline_env()


REPO = Path(__file__).resolve().parent.parent
TASKS = {
    "ar": {"recipe": REPO / "recipes" / "ar" / "tiny" / "char_grpo_async.yaml", "name": "AR GRPO, tiny char LM",
           "delta": 0.3},
    "diffusion": {"recipe": REPO / "recipes" / "diffusion" / "sd3" / "sd3_tiny_flowgrpo_async.yaml",
                  "name": "SD3 Flow-GRPO, tiny model + LoRA", "delta": 0.005},
}
SIDES = {"sync": None, "async-1": 1, "async-2": 2}
"""Side name -> async_rollout.max_staleness (None: the synchronous trainer, no async_rollout section)."""
ASYNC_KEYS = ("async/train_idle_ratio", "async/rollout_idle_ratio", "async/staleness_mean", "async/cache_depth")
KEPT = ("reward/mean", "reward/std", "timing/step", "timing/rollout", "timing/train", "timing/weight_sync",
        "algo/is_weight", *ASYNC_KEYS)
WARMUP = 2
"""Steps excluded from the throughput figures."""
THRESHOLD_WINDOW = 3
TARGET_SPEEDUP, TARGET_EXTRA_STEPS = 1.2, 0.10


# ---------------------------------------------------------------------------------------------
# one run


def trainer_classes(task: str):
    from unirl_ray.trainer.ar import ARTrainer
    from unirl_ray.trainer.async_rl import AsyncARTrainer, AsyncDiffusionTrainer
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    return {"ar": (ARTrainer, AsyncARTrainer), "diffusion": (DiffusionTrainer, AsyncDiffusionTrainer)}[task]


def build(task: str, side: str, seed: int, steps: int, storage: str, overrides: list[str]):
    """The recipe of one run, and its trainer."""
    from unirl_ray.config.recipe import load_recipe

    staleness = SIDES[side]
    cfg = load_recipe(str(TASKS[task]["recipe"]), [
        f"trainer.run_name=bench-{task}-{side}-s{seed}",
        f"trainer.storage_path={storage}",
        f"trainer.num_steps={steps}",
        f"trainer.seed={seed}",
        f"data.seed={seed}",
        "trainer.checkpoint_every=1000000",
        "tracking.log_samples_every=0",
        "tracking.experiment_name=bench-async-vs-sync",
        *([f"async_rollout.max_staleness={staleness}"] if staleness is not None else []),
        *overrides,
    ])
    sync_cls, async_cls = trainer_classes(task)
    if staleness is None:
        del cfg["async_rollout"]
        return cfg, sync_cls(cfg)
    return cfg, async_cls(cfg)


def run_one(task: str, side: str, seed: int, steps: int, storage: str, overrides: list[str]) -> dict[str, Any]:
    """setup(), ``steps`` x (run_step + log_metrics), teardown() (a ``DrivenTrainer``); per-step metrics and wall times."""
    cfg, trainer = build(task, side, seed, steps, storage, overrides)
    samples_per_step = int(cfg.trainer.prompts_per_step) * int(cfg.algorithm.group_size)
    walls: list[float] = []
    ends: list[float] = []  # wall clock (time.time) at the end of each step
    cpu0 = [float("nan")]
    keep = pick(KEPT)

    def on_step(i: int, metrics: dict, times: dict) -> dict[str, float]:
        walls.append(times["wall_s"])
        ends.append(times["end_time"])
        if i == WARMUP:
            cpu0[0] = sum(cpu_seconds())
        return keep(i, metrics, times)

    run = DrivenTrainer(trainer, on_step=on_step, quiet_teardown=True)
    try:
        setup_s = run.setup()
        steps_wall = run.run_block(steps)
        cpu_s = sum(cpu_seconds()) - cpu0[0]
        stream = getattr(trainer, "stream", None)
        busy = list(stream.busy) if stream is not None else None  # (start, end) wall clock of each generation
        run.finish()
    finally:
        run.close()  # teardown_s
    per_step = [run.steps[i] for i in range(1, steps + 1)]
    steady = walls[WARMUP:]
    span = (ends[WARMUP - 1], ends[-1])
    if busy is None:  # sync: the rollout slab works only inside timing/rollout
        rollout_busy = sum(m["timing/rollout"] for m in per_step[WARMUP:]) / (span[1] - span[0])
    else:  # async: the generation intervals the stream recorded, clipped to the measured steps
        rollout_busy = sum(max(0.0, min(b, span[1]) - max(a, span[0])) for a, b in busy) / (span[1] - span[0])
    return {
        "samples_per_step": samples_per_step,
        "setup_s": setup_s,
        "teardown_s": run.teardown_s,
        "steps_wall_s": steps_wall,
        "step_walls_s": walls,
        "cpu_s_per_sample": cpu_s / (samples_per_step * len(steady)),
        "rollout_busy_share": rollout_busy,
        "samples_per_s": samples_per_step * len(steady) / sum(steady),
        "samples_per_s_all_steps": samples_per_step * steps / steps_wall,
        "samples_per_s_step_median": median([samples_per_step / w for w in steady]),
        "series": {k: [m[k] for m in per_step] for k in KEPT},
    }


# ---------------------------------------------------------------------------------------------
# analysis


def analyse(run: dict[str, Any], delta: float) -> None:
    s = run["series"]
    curve = s["reward/mean"]
    start, reach = steps_to_threshold(curve, THRESHOLD_WINDOW, delta)
    run |= {
        "start": start,
        "final_ma": moving_average(curve, THRESHOLD_WINDOW)[-1],
        "steps_to_threshold": reach,
        **{f"median/{k}": median(s[k][WARMUP:]) for k in KEPT if k != "reward/mean"},
    }


def summarise(runs: dict[str, dict[int, dict[str, Any]]], seeds: list[int], steps: int) -> dict[str, Any]:
    """Per side: medians over seeds; ratios to sync (per seed, and of the medians)."""
    out: dict[str, Any] = {}
    sync = runs["sync"]
    for side, per_seed in runs.items():
        reaches = [per_seed[s]["steps_to_threshold"] for s in seeds]
        reached = [r for r in reaches if r is not None]
        sm: dict[str, Any] = {
            "samples_per_s_median": median([per_seed[s]["samples_per_s"] for s in seeds]),
            "step_median_s": median([per_seed[s]["median/timing/step"] for s in seeds]),
            "reached": f"{len(reached)}/{len(reaches)}",
            # a run that never reached counts as "after the budget": the median is then a lower bound
            "steps_to_threshold_median": (median([float(r) if r is not None else float(steps + 1) for r in reaches])
                                          if len(reached) * 2 > len(reaches) else None),
            **{f"{k}_median": median([per_seed[s][f"median/{k}"] for s in seeds]) for k in ASYNC_KEYS},
            "rollout_busy_share_median": median([per_seed[s]["rollout_busy_share"] for s in seeds]),
            "cpu_s_per_sample_median": median([per_seed[s]["cpu_s_per_sample"] for s in seeds]),
        }
        sm["speedup_per_seed"] = [per_seed[s]["samples_per_s"] / sync[s]["samples_per_s"] for s in seeds]
        sm["speedup"] = sm["samples_per_s_median"] / out.get("sync", sm)["samples_per_s_median"]
        sm["steps_ratio_per_seed"] = [
            (per_seed[s]["steps_to_threshold"] / sync[s]["steps_to_threshold"])
            if per_seed[s]["steps_to_threshold"] and sync[s]["steps_to_threshold"] else None for s in seeds]
        base = out.get("sync", sm)["steps_to_threshold_median"]
        mine = sm["steps_to_threshold_median"]
        sm["steps_ratio"] = mine / base if mine and base else None
        sm["target_met"] = (None if side == "sync" else
                            bool(sm["speedup"] >= TARGET_SPEEDUP and sm["steps_ratio"] is not None
                                 and sm["steps_ratio"] <= 1.0 + TARGET_EXTRA_STEPS))
        out[side] = sm
    return out


def report(task: str, args, delta: float, seeds: list[int], runs, summary, load: tuple[float, float]) -> None:
    spec = runs["sync"][seeds[0]]
    print()
    print(f"{TASKS[task]['name']} ({task}): sync vs async (max_staleness 1, 2); {args.steps} steps per run, "
          f"{spec['samples_per_step']} samples/step, seeds {seeds}; throughput over steps {WARMUP + 1}-{args.steps}; "
          f"threshold: 3-step MA of reward/mean >= start + {delta:g}; 1-min load {load[0]:.1f} -> {load[1]:.1f}")
    rows = []
    for side in SIDES:
        for seed in seeds:
            r = runs[side][seed]
            reach = r["steps_to_threshold"]
            rows.append([f"{side} seed {seed}", fmt_num(r["samples_per_s"], 6, 1), fmt_num(r["samples_per_s_step_median"], 6, 1),
                         fmt_num(r["median/timing/step"], 6, 3), fmt_num(r["median/timing/rollout"], 6, 3),
                         fmt_num(r["median/timing/train"], 6, 3),
                         *(fmt_num(r[f"median/{k}"], 5, 2) for k in ASYNC_KEYS),
                         fmt_num(r["rollout_busy_share"], 5, 2), fmt_num(r["cpu_s_per_sample"] * 1000, 5, 1),
                         fmt_num(r["start"], 6, 3), fmt_num(r["final_ma"], 6, 3), str(reach) if reach else f">{args.steps}",
                         fmt_num(r["setup_s"], 5, 1)])
    print_table(["run", "smp/s", "med/s", "step", "rollout", "train", "t-idle", "r-idle", "stale", "cache",
                 "r-busy", "cpu ms", "start", "endMA", "reach", "setup"], rows,
                [16, 6, 6, 6, 7, 6, 6, 6, 5, 5, 6, 6, 6, 6, 5, 5])
    print("  smp/s: samples / wall of the measured steps; med/s: median per-step samples/s; step, rollout, train: "
          "median timing/* (s); t-idle, r-idle: async/train_idle_ratio, async/rollout_idle_ratio; stale: "
          "async/staleness_mean; cache: async/cache_depth (medians over the measured steps); r-busy: share of the measured "
          "wall time in which the engine generated (from the stream's generation intervals; sync: timing/rollout); "
          "cpu ms: CPU ms per sample (this process + the Ray cluster); reach: steps to threshold")
    for side in ("async-1", "async-2"):
        sm = summary[side]
        steps_ratio = f"{sm['steps_ratio']:.2f}x" if sm["steps_ratio"] is not None else "n/a (not reached)"
        per_seed_steps = ", ".join(f"{x:.2f}" if x is not None else "n/a" for x in sm["steps_ratio_per_seed"])
        print(f"RATIO {side}/sync: throughput {sm['speedup']:.2f}x (per seed {', '.join(f'{x:.2f}' for x in sm['speedup_per_seed'])}); "
              f"steps to threshold {steps_ratio} (per seed {per_seed_steps}); target (>= {TARGET_SPEEDUP}x, <= "
              f"+{TARGET_EXTRA_STEPS:.0%} steps): {'MET' if sm['target_met'] else 'NOT MET'}")
    for side in SIDES:
        sm = summary[side]
        med = sm["steps_to_threshold_median"]
        print(f"  {side:<8} samples/s median {sm['samples_per_s_median']:.1f}; steps to threshold median "
              f"{f'{med:g}' if med is not None else f'not reached (> {args.steps})'} (reached {sm['reached']})")
    for side in SIDES:
        for seed in seeds:
            print(f"  curve {side} seed {seed}: " + " ".join(f"{v:.3f}" for v in runs[side][seed]["series"]["reward/mean"]))


def run_task(task: str, args, storage: str) -> dict[str, Any]:
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    delta = args.delta_ar if task == "ar" else args.delta_diffusion
    if delta is None:
        delta = TASKS[task]["delta"]
    runs: dict[str, dict[int, dict[str, Any]]] = {side: {} for side in SIDES}
    order: list[str] = []
    load_start = loadavg_1min()
    t_task = time.perf_counter()
    if args.warmup_runs:
        # The first run in a fresh cluster is slower (cold worker pool, first imports and allocations) and
        # it would always be sync seed 0, a bias for async: pay for it with an unmeasured run first.
        print(f"[bench] {task}: warm-up run (sync, {WARMUP + 2} steps, not measured) ...", flush=True)
        run_one(task, "sync", seeds[0], WARMUP + 2, storage, [*args.overrides, f"trainer.run_name=bench-{task}-warmup"])
    for seed in seeds:
        for side in SIDES:
            print(f"[bench] {task}: seed {seed}, {side} ({args.steps} steps) ... (1-min load {loadavg_1min():.1f})",
                  flush=True)
            run = run_one(task, side, seed, args.steps, storage, args.overrides)
            run["loadavg_1min_end"] = loadavg_1min()
            analyse(run, delta)
            runs[side][seed] = run
            order.append(f"{side}:s{seed}")
            reach = run["steps_to_threshold"]
            print(f"[bench]   {run['samples_per_s']:.1f} samples/s (steps {WARMUP + 1}-{args.steps}), setup "
                  f"{run['setup_s']:.1f} s, reward {run['start']:.3f} -> {run['final_ma']:.3f} (3-step MA), "
                  f"threshold at step {reach if reach else f'> {args.steps}'}", flush=True)
            if args.json_out:  # each finished run at once: a bench stopped part-way keeps what it measured
                with open(f"{args.json_out}.runs.jsonl", "a", encoding="utf-8") as f:
                    f.write(json.dumps({"task": task, "side": side, "seed": seed, "delta": delta, "run": run}) + "\n")
    load = (load_start, loadavg_1min())
    summary = summarise(runs, seeds, args.steps)
    report(task, args, delta, seeds, runs, summary, load)
    return {"seeds": seeds, "steps": args.steps, "delta": delta, "window": THRESHOLD_WINDOW, "warmup_steps": WARMUP,
            "recipe": str(TASKS[task]["recipe"].relative_to(REPO)), "order": order, "summary": summary,
            "loadavg_1min": {"start": load[0], "end": load[1]}, "wall_s": time.perf_counter() - t_task,
            "runs": {side: {str(s): r for s, r in v.items()} for side, v in runs.items()}}


def reanalyse(path: str, args) -> dict[str, Any]:
    """A previous run's JSON result with the thresholds recomputed (``--delta-*``; default: the file's deltas)."""
    result = json.loads(Path(path).read_text(encoding="utf-8"))
    for task in ("ar", "diffusion"):
        if task not in result:
            continue
        t = result[task]
        delta = {"ar": args.delta_ar, "diffusion": args.delta_diffusion}[task]
        delta = t["delta"] if delta is None else delta
        runs = {side: {int(s): r for s, r in t["runs"][side].items()} for side in SIDES}
        for per_seed in runs.values():
            for run in per_seed.values():
                analyse(run, delta)
        summary = summarise(runs, t["seeds"], t["steps"])
        report(task, argparse.Namespace(steps=t["steps"]), delta, t["seeds"], runs, summary,
               (t["loadavg_1min"]["start"], t["loadavg_1min"]["end"]))
        t |= {"delta": delta, "summary": summary}
    result["reanalysed_from"] = path
    return result


# ---------------------------------------------------------------------------------------------
# driver


def start_ray() -> None:
    """One embedded local Ray for every run: 8 logical CPUs (fractional Serve / Data / Train requests fit)."""
    import ray

    from unirl_ray.runtime.cluster import runtime_env_vars

    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": runtime_env_vars()},
             log_to_driver=False)  # the Serve replicas log every call: printing that costs the 2 shared cores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("ar", "diffusion", "all"), default="all", help="which task (default all)")
    ap.add_argument("--steps", type=int, default=None,
                    help="RL steps per run, the step budget (default 24 for ar, 16 for diffusion)")
    ap.add_argument("--seeds", default="0,1", help="comma-separated trainer/data seeds (default 0,1)")
    ap.add_argument("--delta-ar", type=float, default=None,
                    help=f"ar threshold: start + delta (default {TASKS['ar']['delta']}, fraction of 'a')")
    ap.add_argument("--delta-diffusion", type=float, default=None,
                    help=f"diffusion threshold: start + delta (default {TASKS['diffusion']['delta']}, brightness)")
    ap.add_argument("--json-out", default=None,
                    help="also write the JSON result line to this file, and each finished run at once to <file>.runs.jsonl")
    ap.add_argument("--keep-storage", action="store_true", help="keep the temporary storage path (MLflow DB)")
    ap.add_argument("--warmup-runs", type=int, choices=(0, 1), default=1,
                    help="an unmeasured short sync run before each task's runs (default 1; 0: none)")
    ap.add_argument("--reanalyse", metavar="JSON", default=None,
                    help="run nothing: recompute the thresholds (--delta-*) of an earlier --json-out result and report")
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides key=value (applied to every run)")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps <= max(WARMUP, THRESHOLD_WINDOW):
        ap.error(f"--steps must exceed {max(WARMUP, THRESHOLD_WINDOW)} (warm-up and the first threshold window)")
    if not [s for s in args.seeds.split(",") if s.strip()]:
        ap.error("--seeds needs at least one seed")
    logging.basicConfig(level=os.environ.get("UNIRL_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    if args.reanalyse:
        emit_json(reanalyse(args.reanalyse, args), args.json_out)
        return 0

    tasks = ["ar", "diffusion"] if args.task == "all" else [args.task]
    default_steps = {"ar": 24, "diffusion": 16}
    t_all = time.perf_counter()
    storage = tempfile.mkdtemp(prefix="unirl_bench_async_")
    load_start = loadavg_1min()
    result: dict[str, Any] = {"bench": "async_vs_sync", "task": args.task, "overrides": args.overrides,
                              "target": {"speedup_min": TARGET_SPEEDUP, "extra_steps_max": TARGET_EXTRA_STEPS}}
    try:
        start_ray()
        for task in tasks:
            task_args = argparse.Namespace(**{**vars(args), "steps": args.steps or default_steps[task]})
            result[task] = run_task(task, task_args, storage)
    finally:
        shutdown_ray()
        if not args.keep_storage:
            shutil.rmtree(storage, ignore_errors=True)
    finish_report(result, load_start, t_all, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
