"""Diffusion RL on the tiny SD3: DiffusionNFT vs Flow-GRPO (steps to a reward threshold), and the time
per step of the three rollout layouts (trainside, dedicated engine colocated, dedicated engine separate).

A benchmark, not a test: it asserts nothing about speed or learning. Everything runs through the real
``DiffusionTrainer`` (``setup()``, ``run_step(i)`` per step with its metrics logged to MLflow, then
``teardown()``) in one embedded local Ray cluster, with a fresh temporary storage path.

``--part algos``: for each seed in ``--seeds`` (``trainer.seed`` and ``data.seed``: the prompts and the
per-sample noise; the tiny model's initial weights are fixed by the recipes), DiffusionNFT
(``recipes/diffusion/sd3/sd3_tiny_nft.yaml``: ODE sampling with the EMA shadow adapter) and Flow-GRPO
(``recipes/diffusion/sd3/sd3_tiny_flowgrpo.yaml``: SDE sampling) train side by side on the same task
(tiny SD3, brightness reward, same prompts, seeds, samples per step and step budget), in alternating
blocks of steps. Per run: the reward curve (``reward/mean`` per step), its start (the mean of the first
``--window`` steps) and the first step whose ``--window``-step moving average reaches start +
``--delta`` (steps to threshold), and the median ``timing/step``.

``--part layouts``: the same Flow-GRPO task (the engine recipe's LoRA settings) in three layouts, on the
same number of train workers (``--layout-workers``, default 2) and samples per step, after warm-up, in interleaved blocks T, C, S, T, ...:

  (T) trainside: the train ranks sample with the module they train (``sd3_tiny_flowgrpo.yaml`` with the
      engine recipe's LoRA adapters and learning rate);
  (C) dedicated engine, ``rollout.placement: colocated``: engine and workers take turns (workers
      offload, the engine wakes with the latest version, generates, sleeps, the workers onload);
  (S) dedicated engine, ``placement: separate`` (``sd3_tiny_flowgrpo_engine.yaml``): the engine stays
      resident and receives the LoRA adapters after every step.

It prints the medians of ``timing/step``, ``timing/rollout``, ``timing/train`` and
``timing/weight_sync`` of each layout and their ratios to trainside.

    python bench/diffusion_algos_layouts.py                         # both parts, ~8-12 min on 2 busy cores
    python bench/diffusion_algos_layouts.py --part algos --seeds 0,1,2 --steps 24 --delta 0.01
    python bench/diffusion_algos_layouts.py --part layouts --layout-workers 2 --json-out /tmp/layouts.json

See bench/README.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402  (bench/ is on sys.path when run as a script)
    DrivenTrainer, Interleave, close_all, pick,
    moving_average, steps_to_threshold,
    finish_report, shutdown_ray,
    fmt_num, loadavg_1min, median, offline_env, print_table,
)

offline_env()

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SD3 = REPO / "recipes" / "diffusion" / "sd3"
ALGO_RECIPES = {"nft": SD3 / "sd3_tiny_nft.yaml", "flowgrpo": SD3 / "sd3_tiny_flowgrpo.yaml"}
ALGO_NAMES = {"nft": "DiffusionNFT", "flowgrpo": "Flow-GRPO"}
LAYOUT_NAMES = {"T": "trainside", "C": "engine, colocated", "S": "engine, separate"}
TIMINGS = ("step", "rollout", "reward", "train", "weight_sync")
KEPT = ("reward/mean", "reward/std", *(f"timing/{k}" for k in TIMINGS),
        "timing/engine_wake", "timing/engine_sleep", "timing/offload_onload")


# ---------------------------------------------------------------------------------------------
# one trainer, driven block by block


def trainer_run(recipe) -> DrivenTrainer:
    """A real ``DiffusionTrainer``: ``setup()``, then ``run_block(n)`` (``run_step`` per step, metrics
    logged to MLflow; no checkpoints and no sample images), then ``close()``."""
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    return DrivenTrainer(DiffusionTrainer(recipe), on_step=pick(KEPT), quiet_teardown=True)


def load(path: Path, storage: str, name: str, steps: int, overrides: list[str]):
    from unirl_ray.config.recipe import load_recipe

    return load_recipe(str(path), [
        f"trainer.run_name={name}",
        f"trainer.storage_path={storage}",
        f"trainer.num_steps={steps}",
        "trainer.checkpoint_every=1000000",
        "tracking.log_samples_every=0",
        "tracking.experiment_name=bench-diffusion-algos-layouts",
        *overrides,
    ])


def section_diff(a, b, sections: tuple[str, ...]) -> list[str]:
    """Dotted keys (under ``sections``) whose resolved values differ between recipes ``a`` and ``b``."""
    from omegaconf import OmegaConf

    def flat(node: Any, prefix: str) -> dict[str, Any]:
        if isinstance(node, dict):
            out: dict[str, Any] = {}
            for k, v in node.items():
                out |= flat(v, f"{prefix}.{k}")
            return out
        return {prefix: node}

    fa, fb = {}, {}
    for s in sections:
        fa |= flat(OmegaConf.to_container(a[s], resolve=True), s) if s in a else {}
        fb |= flat(OmegaConf.to_container(b[s], resolve=True), s) if s in b else {}
    return sorted(k for k in set(fa) | set(fb) if fa.get(k, "<unset>") != fb.get(k, "<unset>"))


# ---------------------------------------------------------------------------------------------
# part 1: DiffusionNFT vs Flow-GRPO


def run_algos(args, storage: str, out: dict[str, Any]) -> None:
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    runs: dict[str, dict[int, dict[str, Any]]] = {a: {} for a in ALGO_RECIPES}
    common = [f"ray.scaling.num_workers={args.workers}", *args.overrides]
    recipes = {a: load(p, storage, f"probe-{a}", args.steps, common) for a, p in ALGO_RECIPES.items()}
    differences = section_diff(recipes["nft"], recipes["flowgrpo"],
                               ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout", "data", "reward"))
    schedule: list[str] = []
    for seed in seeds:
        sides: dict[str, DrivenTrainer] = {}
        try:
            for algo, path in ALGO_RECIPES.items():
                recipe = load(path, storage, f"algos-{algo}-s{seed}", args.steps,
                              [*common, f"trainer.seed={seed}", f"data.seed={seed}"])
                print(f"[bench] seed {seed}: setting up {ALGO_NAMES[algo]} ...", flush=True)
                sides[algo] = trainer_run(recipe)
                runs[algo][seed] = {"setup_s": sides[algo].setup()}
            done = 0
            while done < args.steps:
                n = min(args.block_steps, args.steps - done)
                for algo, side in sides.items():
                    side.run_block(n)
                    schedule.append(f"{algo}:s{seed}x{n}")
                done += n
                print(f"[bench] seed {seed}: {done}/{args.steps} steps; reward/mean "
                      + ", ".join(f"{ALGO_NAMES[a]} {s.steps[done]['reward/mean']:.4f}" for a, s in sides.items()),
                      flush=True)
            for side in sides.values():
                side.finish()
        finally:
            close_all({ALGO_NAMES[algo]: side for algo, side in sides.items()})
        steps = list(range(1, args.steps + 1))
        timed = steps[1:]  # step 1 also pays first-call costs
        for algo, side in sides.items():
            curve = side.series("reward/mean", steps)
            start, reach = steps_to_threshold(curve, args.window, args.delta)
            ma = moving_average(curve, args.window)
            runs[algo][seed] |= {
                "reward_curve": curve,
                "reward_std_first": float(np.mean(side.series("reward/std", steps[:args.window]))),
                "start": start,
                "final_ma": ma[-1],
                "gain": ma[-1] - start,
                "steps_to_threshold": reach,
                "step_median_s": median(side.series("timing/step", timed)),
                "rollout_median_s": median(side.series("timing/rollout", timed)),
                "train_median_s": median(side.series("timing/train", timed)),
            }

    # ---------------------------------------------------------------- report
    print()
    print(f"DiffusionNFT vs Flow-GRPO on the tiny SD3 (brightness reward), {args.steps} steps per run, "
          f"{args.workers} Ray Train worker(s), seeds {seeds}; threshold: the {args.window}-step moving average of "
          f"reward/mean >= start + {args.delta:g} (start = mean of steps 1-{args.window})")
    print(f"recipe keys that differ (what each algorithm needs): {', '.join(differences) or 'none'}")
    rows = []
    for algo in ALGO_RECIPES:
        for seed in seeds:
            r = runs[algo][seed]
            reach = r["steps_to_threshold"]
            rows.append([f"{ALGO_NAMES[algo]} seed {seed}", fmt_num(r["start"], 7, 4), fmt_num(r["final_ma"], 7, 4),
                         fmt_num(r["gain"], 7, 4), fmt_num(r["reward_std_first"], 7, 4),
                         str(reach) if reach else f">{args.steps}", fmt_num(r["step_median_s"]),
                         fmt_num(r["rollout_median_s"]), fmt_num(r["train_median_s"])])
    print_table(["run", "start", "end MA", "gain", "std@1-3", "reach", "step s", "rollout", "train"], rows,
                [22, 7, 7, 7, 7, 6, 7, 7, 7])
    summary: dict[str, Any] = {}
    for algo in ALGO_RECIPES:
        reaches = [runs[algo][s]["steps_to_threshold"] for s in seeds]
        reached = [r for r in reaches if r is not None]
        # a run that never reached counts as "after the budget" (so the median is a lower bound then)
        med = median([float(r) if r is not None else float(args.steps + 1) for r in reaches])
        summary[algo] = {
            "steps_to_threshold_median": med if len(reached) * 2 > len(reaches) else None,
            "reached": f"{len(reached)}/{len(reaches)}",
            "gain_median": median([runs[algo][s]["gain"] for s in seeds]),
            "step_median_s": median([runs[algo][s]["step_median_s"] for s in seeds]),
        }
        sm = summary[algo]
        print(f"{ALGO_NAMES[algo]:<13} steps to threshold: median "
              + (f"{sm['steps_to_threshold_median']:g}" if sm["steps_to_threshold_median"] is not None
                 else f"not reached (> {args.steps})")
              + f", reached in {sm['reached']} runs; gain over {args.steps} steps (median) {sm['gain_median']:+.4f}; "
              f"timing/step median {sm['step_median_s']:.3f} s")
    nft, grpo = summary["nft"], summary["flowgrpo"]
    if nft["steps_to_threshold_median"] and grpo["steps_to_threshold_median"]:
        print(f"RATIO steps to threshold NFT/Flow-GRPO = {nft['steps_to_threshold_median'] / grpo['steps_to_threshold_median']:.2f}x; "
              f"time per step NFT/Flow-GRPO = {nft['step_median_s'] / grpo['step_median_s']:.2f}x")
    for algo in ALGO_RECIPES:
        for seed in seeds:
            print(f"  curve {ALGO_NAMES[algo]} seed {seed}: "
                  + " ".join(f"{v:.4f}" for v in runs[algo][seed]["reward_curve"]))
    out["algos"] = {"seeds": seeds, "steps": args.steps, "window": args.window, "delta": args.delta,
                    "workers": args.workers, "recipe_differences": differences, "schedule": schedule,
                    "runs": {a: {str(s): r for s, r in v.items()} for a, v in runs.items()}, "summary": summary}


# ---------------------------------------------------------------------------------------------
# part 2: layouts


def layout_recipes(storage: str, total: int, args) -> dict[str, Any]:
    """The three layouts of one Flow-GRPO task: the engine recipe's model, LoRA, optimizer and batch."""
    from omegaconf import OmegaConf

    common = [f"ray.scaling.num_workers={args.layout_workers}", *args.overrides]
    separate = load(SD3 / "sd3_tiny_flowgrpo_engine.yaml", storage, "layout-separate", total, common)
    colocated = load(SD3 / "sd3_tiny_flowgrpo_engine.yaml", storage, "layout-colocated", total,
                     [*common, "rollout.placement=colocated"])
    lora = OmegaConf.to_container(separate.backend.lora_cfg, resolve=True)
    lora_override = "backend.lora_cfg={" + ", ".join(f"{k}: {v}" for k, v in lora.items()) + "}"
    trainside = load(SD3 / "sd3_tiny_flowgrpo.yaml", storage, "layout-trainside", total, [
        lora_override, f"backend.optimizer_cfg.learning_rate={separate.backend.optimizer_cfg.learning_rate}", *common])
    shared = ("bundle", "pipeline", "backend", "algorithm", "stack", "data", "reward")
    for name, other in (("trainside", trainside), ("colocated", colocated)):
        diff = section_diff(separate, other, shared)
        if diff:
            raise SystemExit(f"the {name} layout's recipe differs from the separate one in {diff}; "
                             "the comparison needs the same task")
    for key in ("seed", "prompts_per_step"):
        if trainside.trainer[key] != separate.trainer[key]:
            raise SystemExit(f"trainer.{key} differs between the trainside and engine recipes")
    return {"T": trainside, "C": colocated, "S": separate}


def run_layouts(args, storage: str, out: dict[str, Any]) -> None:
    total = args.layout_warmup + args.layout_blocks * args.layout_block_steps
    recipes = layout_recipes(storage, total, args)
    sides: dict[str, DrivenTrainer] = {}
    setup_s: dict[str, float] = {}
    blocks = Interleave(recipes)
    try:
        for key, recipe in recipes.items():
            print(f"[bench] setting up {key} ({LAYOUT_NAMES[key]}) ...", flush=True)
            sides[key] = trainer_run(recipe)
            setup_s[key] = sides[key].setup()
        print(f"[bench] warm-up: {args.layout_warmup} steps of each layout", flush=True)
        for key, side in sides.items():
            blocks.run(key, args.layout_warmup, side.run_block, measured=False)
        for block in range(args.layout_blocks):
            print(f"[bench] block {block + 1}/{args.layout_blocks}: T, C, S, {args.layout_block_steps} steps each",
                  flush=True)
            for key, side in sides.items():
                blocks.run(key, args.layout_block_steps, side.run_block, measured=True)
        for side in sides.values():
            side.finish()
    finally:
        close_all({LAYOUT_NAMES[key]: side for key, side in reversed(list(sides.items()))})
    schedule, walls = blocks.order, blocks.walls

    measured = list(range(args.layout_warmup + 1, total + 1))
    stats: dict[str, dict[str, Any]] = {}
    for key, side in sides.items():
        med = {k: median(side.series(f"timing/{k}", measured)) for k in TIMINGS}
        med |= {k: median(side.series(f"timing/{k}", measured)) for k in ("engine_wake", "engine_sleep", "offload_onload")}
        blocks = [median(side.series("timing/step", measured[b * args.layout_block_steps:(b + 1) * args.layout_block_steps]))
                  for b in range(args.layout_blocks)]
        stats[key] = {"median_s": med, "block_step_medians_s": blocks, "step_min_s": min(side.series("timing/step", measured)),
                      "wall_per_step_median_s": median(walls[key]), "setup_s": setup_s[key],
                      "reward_curve": side.series("reward/mean", list(range(1, total + 1)))}
    t = stats["T"]["median_s"]["step"]
    for key in stats:
        stats[key]["ratio_step_vs_trainside"] = stats[key]["median_s"]["step"] / t
        stats[key]["ratio_per_block_vs_trainside"] = [a / b for a, b in zip(stats[key]["block_step_medians_s"],
                                                                            stats["T"]["block_step_medians_s"])]

    sep = recipes["S"]
    samples = int(sep.trainer.prompts_per_step) * int(sep.algorithm.group_size)
    print()
    print(f"Flow-GRPO layouts on the tiny SD3 (LoRA rank {sep.backend.lora_cfg.rank}), {samples} samples/step, "
          f"{sep.pipeline.num_inference_steps} SDE steps, {args.layout_workers} Ray Train worker(s) in every layout; warm-up "
          f"{args.layout_warmup} steps each, then {args.layout_blocks} blocks x {args.layout_block_steps} steps "
          f"(T, C, S, T, ...); medians over {len(measured)} measured steps per layout, seconds")
    rows = []
    for key, st in stats.items():
        m = st["median_s"]
        rows.append([f"{key} {LAYOUT_NAMES[key]}", fmt_num(m["step"]), fmt_num(m["rollout"]), fmt_num(m["reward"]),
                     fmt_num(m["train"]), fmt_num(m["weight_sync"]), fmt_num(m["engine_wake"]), fmt_num(m["engine_sleep"]),
                     fmt_num(m["offload_onload"]), fmt_num(st["step_min_s"]), fmt_num(st["ratio_step_vs_trainside"], 6, 2)])
    print_table(["layout", "step", "rollout", "reward", "train", "sync", "wake", "sleep", "off/on*", "min", "x T"], rows,
                [20, 7, 7, 7, 7, 7, 7, 7, 7, 7, 6])
    print("  * timing/offload_onload as the trainer logs it: the colocated rollout minus the engine's wake and sleep, "
          "so it also holds the engine's generate call")
    for key in ("C", "S"):
        st = stats[key]
        print(f"  {key}/T per block: {' '.join(f'{r:.2f}' for r in st['ratio_per_block_vs_trainside'])}; "
              f"rollout {st['median_s']['rollout'] / stats['T']['median_s']['rollout']:.2f}x, "
              f"train {st['median_s']['train'] / stats['T']['median_s']['train']:.2f}x")
    print(f"  setup seconds: {', '.join(f'{k} {v:.1f}' for k, v in setup_s.items())}; reward/mean at the last step: "
          + ", ".join(f"{k} {st['reward_curve'][-1]:.4f}" for k, st in stats.items()))
    out["layouts"] = {"workers": args.layout_workers, "samples_per_step": samples, "warmup_steps": args.layout_warmup,
                      "blocks": args.layout_blocks, "block_steps": args.layout_block_steps, "schedule": schedule,
                      "stats": stats}


# ---------------------------------------------------------------------------------------------
# driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("algos", "layouts", "all"), default="all", help="which comparison to run")
    ap.add_argument("--workers", type=int, default=1, help="algos: Ray Train workers of every run (default 1)")
    ap.add_argument("--seeds", default="0,1", help="algos: comma-separated trainer/data seeds (default 0,1)")
    ap.add_argument("--steps", type=int, default=24, help="algos: RL steps per run, the step budget (default 24)")
    ap.add_argument("--block-steps", type=int, default=4, help="algos: steps per alternating block (default 4)")
    ap.add_argument("--window", type=int, default=3, help="algos: moving-average window of reward/mean (default 3)")
    ap.add_argument("--delta", type=float, default=0.01,
                    help="algos: the threshold is the first window's mean + delta (default 0.01 brightness)")
    ap.add_argument("--layout-workers", type=int, default=2,
                    help="layouts: Ray Train workers of every layout (default 2; see bench/README.md for 1)")
    ap.add_argument("--layout-warmup", type=int, default=2, help="layouts: warm-up steps per layout, excluded")
    ap.add_argument("--layout-blocks", type=int, default=4, help="layouts: measured blocks per layout")
    ap.add_argument("--layout-block-steps", type=int, default=3, help="layouts: steps per block")
    ap.add_argument("--json-out", default=None, help="also write the JSON result line to this file")
    ap.add_argument("--keep-storage", action="store_true", help="keep the temporary storage path (MLflow DB)")
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides key=value (applied to every run)")
    args = ap.parse_args(argv)
    if min(args.workers, args.layout_workers, args.steps, args.block_steps, args.window, args.layout_warmup, args.layout_blocks,
           args.layout_block_steps) < 1:
        ap.error("--workers, --layout-workers, --steps, --block-steps, --window and the --layout-* counts must be >= 1")
    if args.steps <= args.window:
        ap.error("--steps must exceed --window (the threshold is checked after the first window)")
    logging.basicConfig(level=os.environ.get("UNIRL_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")

    t_all = time.perf_counter()
    storage = tempfile.mkdtemp(prefix="unirl_bench_diffusion_")
    load_start = loadavg_1min()
    result: dict[str, Any] = {"bench": "diffusion_algos_layouts", "part": args.part, "overrides": args.overrides}
    try:
        if args.part in ("algos", "all"):
            run_algos(args, storage, result)
        if args.part in ("layouts", "all"):
            run_layouts(args, storage, result)
    finally:
        shutdown_ray()
        if not args.keep_storage:
            shutil.rmtree(storage, ignore_errors=True)
    finish_report(result, load_start, t_all, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
