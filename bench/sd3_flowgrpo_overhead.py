"""Overhead of the unirl_ray trainer vs. a bare PyTorch loop: SD3 Flow-GRPO, tiny model, CPU.

A benchmark, not a test: it asserts nothing about speed. It prints the steady-state time per RL
step of

  (A) the real ``DiffusionTrainer`` on ``recipes/diffusion/sd3/sd3_tiny_flowgrpo.yaml``: Ray Train
      workers (FSDP2 over gloo), the reward Serve app, Ray Data prompts, MLflow (a fresh SQLite
      store in a temporary storage path);
  (B) a bare single-process loop doing the same Flow-GRPO math on the same tiny SD3 (same config,
      same seeds, same prompts, same number of samples per step): ``SD3Pipeline.sample`` /
      ``collate`` / ``step_log_prob``, the brightness reward inline with numpy, group advantages
      inline, the clipped Flow-GRPO surrogate over every timestep, ``torch.optim.AdamW``. No
      FSDPBackend, TrainStack, Ray or MLflow;

after warm-up, in alternating blocks A, B, A, B, ..., as medians over steps, their ratio, and
A's per-stage breakdown (``timing/rollout``, ``timing/reward``, ``timing/train``, read back from
the trainer's MLflow run).

    python bench/sd3_flowgrpo_overhead.py                       # 2 workers, ~3-5 min on 2 busy cores
    python bench/sd3_flowgrpo_overhead.py --workers 1 --json-out /tmp/overhead.json

See bench/README.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (  # noqa: E402  (bench/ is on sys.path when run as a script)
    DrivenTrainer, Interleave,
    shutdown_ray,
    emit_json, fmt_num, median, offline_env, print_table,
)

offline_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402


REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "diffusion" / "sd3" / "sd3_tiny_flowgrpo.yaml"
STAGES = ("rollout", "reward", "train")
A_KEYS = ("timing/step", "timing/rollout", "timing/reward", "timing/train", "timing/train_step",
          "reward/mean", "rollout/logp_gap")


# ---------------------------------------------------------------------------------------------
# (A) the trainer, driven block by block (``DrivenTrainer``: ``setup()``, ``run_step(i)`` per step,
# logged to MLflow and checkpointed as ``run_steps`` does, ``teardown()``)


def _a_record(step: int, metrics: dict, times: dict) -> dict[str, float]:
    return {k: float(metrics[k]) for k in A_KEYS if k in metrics}


# ---------------------------------------------------------------------------------------------
# (B) the bare loop


class BareLoop:
    """Same model, seeds, prompts, samples per step and Flow-GRPO math; one process, plain torch."""

    def __init__(self, recipe, *, workers: int, prompt_fallback: list[str]) -> None:
        from unirl_ray.config.recipe import instantiate
        from unirl_ray.trainer.base import derive_seed

        self.derive_seed = derive_seed
        self.seed = int(recipe.trainer.seed)
        self.prompts_per_step = int(recipe.trainer.prompts_per_step)
        algo = recipe.algorithm
        self.group_size = int(algo.group_size)
        self.clip_range = float(algo.clip_range)
        self.adv_clip_max = float(algo.adv_clip_max)
        self.normalize_std = bool(algo.normalize_std)
        if float(algo.get("kl_beta", 0.0)) != 0.0 or float(algo.get("timestep_fraction", 1.0)) != 1.0:
            raise SystemExit("the bare loop implements kl_beta=0 and timestep_fraction=1 (every timestep) only")
        if recipe.backend.get("lora_cfg") is not None:
            raise SystemExit("the bare loop implements full fine-tuning only (backend.lora_cfg: null)")
        n = self.prompts_per_step * self.group_size
        self.num_samples = n
        self.rollout_micro = int(recipe.rollout.micro_batch_size)
        self.micro = int(recipe.stack.micro_batch_size)
        # The trainer's mini-batch counts samples over all ranks, so both sides take the same
        # number of optimizer steps per RL step.
        mini = recipe.stack.get("mini_batch_size")
        self.mini = n if mini is None else min(n, int(mini))
        self.max_grad_norm = recipe.stack.get("max_grad_norm")
        self.prompt_fallback = prompt_fallback

        torch.manual_seed(self.seed)  # as the train workers do before building
        self.bundle = instantiate(recipe.bundle)
        self.pipeline = instantiate(recipe.pipeline, bundle=self.bundle)
        self.model = self.bundle.transformer
        self.model.requires_grad_(True)
        opt = recipe.backend.optimizer_cfg
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=float(opt.learning_rate),
            weight_decay=float(opt.get("weight_decay", 0.0)),
            betas=tuple(float(b) for b in opt.get("betas", (0.9, 0.999))),
            eps=float(opt.get("eps", 1e-8)),
            fused=bool(opt.get("fused", True)),  # the trainer's AdamW kernel (OptimizerConfig.fused)
        )
        self.step_index = 0

    def step(self, prompts: list[str] | None) -> dict[str, float]:
        self.step_index += 1
        step = self.step_index
        t_step = time.perf_counter()
        P, G, n = self.prompts_per_step, self.group_size, self.num_samples
        if prompts is None:  # the trainer's prompts of this step are used whenever they exist
            prompts = [self.prompt_fallback[(step * P + p) % len(self.prompt_fallback)] for p in range(P)]
        all_prompts = [prompts[i // G] for i in range(n)]
        seeds = [self.derive_seed(self.seed, "sample", step, i) for i in range(n)]

        t0 = time.perf_counter()
        parts, images = [], []
        for lo in range(0, n, self.rollout_micro):
            for part, image in self.pipeline.sample(all_prompts[lo:lo + self.rollout_micro], seeds[lo:lo + self.rollout_micro]):
                parts.append(part)
                images.append(image)
        t_rollout = time.perf_counter() - t0

        t0 = time.perf_counter()
        rewards = np.stack(images).reshape(n, -1).mean(axis=1, dtype=np.float64) / 255.0  # brightness
        grouped = rewards.reshape(P, G)
        centered = grouped - grouped.mean(axis=1, keepdims=True)
        if self.normalize_std:
            centered = centered / (grouped.std(axis=1, keepdims=True) + 1e-4)
        adv = torch.from_numpy(np.clip(centered.reshape(n), -self.adv_clip_max, self.adv_clip_max)).float()
        t_reward = time.perf_counter() - t0

        t0 = time.perf_counter()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.derive_seed(self.seed, "train", step)))
        gap = torch.zeros(())
        clipped_pairs = torch.zeros(())
        first = True
        for lo in range(0, n, self.mini):
            mini = order[lo:lo + self.mini].tolist()
            n_micro = -(-len(mini) // self.micro)
            for mlo in range(0, len(mini), self.micro):
                idx = mini[mlo:mlo + self.micro]
                batch = self.pipeline.collate([parts[i] for i in idx])
                old, a = batch["log_probs"], adv[idx]
                steps = old.shape[1]
                for j in range(steps):
                    logp, _, _ = self.pipeline.step_log_prob(self.model, batch, torch.full((len(idx),), j, dtype=torch.long))
                    ratio = torch.exp(logp - old[:, j])
                    surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - self.clip_range, 1 + self.clip_range))
                    (surrogate.mean() / (n_micro * steps)).backward()
                    with torch.no_grad():
                        clipped_pairs += ((ratio - 1).abs() > self.clip_range).sum()
                        if first:
                            gap = torch.maximum(gap, (logp - old[:, j]).abs().max())
            if self.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(self.max_grad_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            first = False
        t_train = time.perf_counter() - t0
        return {
            "timing/step": time.perf_counter() - t_step,
            "timing/rollout": t_rollout,
            "timing/reward": t_reward,
            "timing/train": t_train,
            "reward/mean": float(rewards.mean()),
            "rollout/logp_gap": float(gap),
            "algo/clip_frac": float(clipped_pairs) / (n * len(parts[0].log_probs)),
        }


# ---------------------------------------------------------------------------------------------
# driver


def _thread_niceness() -> list[int]:
    """Distinct nice values of this process's threads (Linux; [] elsewhere)."""
    values = set()
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            values.add(int(stat.read_text().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):
            pass
    return sorted(values)


def _fmt(x: float, unit: str = "") -> str:
    return fmt_num(x, unit=unit, missing="n/a")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="diffusion recipe (default: the tiny SD3 Flow-GRPO one)")
    ap.add_argument("--workers", type=int, default=2, help="Ray Train workers of the trainer (1 or 2 on a 2-core machine)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps of each side, excluded from the medians")
    ap.add_argument("--blocks", type=int, default=6, help="measured blocks per side (A,B,A,B,...)")
    ap.add_argument("--block-steps", type=int, default=4, help="RL steps per block")
    ap.add_argument("--bare-threads", type=int, default=None,
                    help="torch intra-op threads of the bare loop (default: torch's default for this machine)")
    ap.add_argument("--bare-nice", type=int, default=None,
                    help="renice the bench's main thread (and the torch threads it starts) before the bare loop is "
                         "built, e.g. 15 = the niceness Ray gives its workers (default: leave it)")
    ap.add_argument("--json-out", default=None, help="also write the JSON result line to this file")
    ap.add_argument("--keep-storage", action="store_true", help="keep the temporary storage path (MLflow DB, checkpoints)")
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides key=value (applied to both sides)")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.warmup < 1 or args.blocks < 1 or args.block_steps < 1:
        ap.error("--workers, --warmup, --blocks and --block-steps must be >= 1")
    return args


def run_sides(args, recipe, total: int, storage: str) -> dict[str, Any]:
    """Set up A, build B, warm-up, then the interleaved blocks A, B, A, B, ...; A torn down at the end."""
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    prompt_file = Path(recipe.data.path)
    fallback_prompts = [line.strip() for line in prompt_file.read_text().splitlines() if line.strip()]
    driver = DrivenTrainer(DiffusionTrainer(recipe), on_step=_a_record, checkpoint_steps=total)
    blocks = Interleave("AB")
    b_metrics: dict[int, dict[str, float]] = {}
    try:
        print(f"[bench] setting up the trainer ({args.workers} workers) in {storage} ...", flush=True)
        setup_s = driver.setup()
        print(f"[bench] trainer ready in {setup_s:.1f}s; building the bare loop ...", flush=True)
        if args.bare_nice is not None:  # Linux: per thread; threads started later inherit it
            os.setpriority(os.PRIO_PROCESS, 0, args.bare_nice)
        bare = BareLoop(recipe, workers=args.workers, prompt_fallback=fallback_prompts)

        def run_b(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                m = bare.step(driver.prompts_of(bare.step_index + 1))
                b_metrics[bare.step_index] = m
            return time.perf_counter() - t0

        print(f"[bench] warm-up: {args.warmup} steps of A, then of B", flush=True)
        blocks.run("A", args.warmup, driver.run_block, measured=False)
        blocks.run("B", args.warmup, run_b, measured=False)
        for block in range(args.blocks):
            print(f"[bench] block {block + 1}/{args.blocks}: A then B, {args.block_steps} steps each", flush=True)
            blocks.run("A", args.block_steps, driver.run_block, measured=True)
            blocks.run("B", args.block_steps, run_b, measured=True)
        driver.finish()
        bare_nice = _thread_niceness()
    finally:
        driver.close()
    history = {k: {s: rec[k] for s, rec in driver.steps.items() if k in rec} for k in A_KEYS}
    return {"history": history, "b_metrics": b_metrics, "blocks": blocks, "setup_s": setup_s,
            "bare_nice": bare_nice, "samples": bare.num_samples}


def summarise(args, run: dict[str, Any], total: int) -> dict[str, Any]:
    """Medians of both sides, their ratios (overall, per block pair, fastest steps), CPU and the checks."""
    history, b_metrics, blocks = run["history"], run["b_metrics"], run["blocks"]
    measured = list(range(args.warmup + 1, total + 1))
    missing = [s for s in measured if s not in history["timing/step"]]
    if missing:
        raise SystemExit(f"the trainer's MLflow run lacks timing/step for steps {missing}")

    def a_series(key: str) -> list[float]:
        return [history[key][s] for s in measured if s in history[key]]

    def b_series(key: str) -> list[float]:
        return [b_metrics[s][key] for s in measured]

    a = {k: median(a_series(f"timing/{k}")) for k in ("step", *STAGES, "train_step")}
    b = {k: median(b_series(f"timing/{k}")) for k in ("step", *STAGES)}
    a["other"] = median([history["timing/step"][s] - sum(history[f"timing/{k}"].get(s, 0.0) for k in STAGES) for s in measured])
    b["other"] = median([b_metrics[s]["timing/step"] - sum(b_metrics[s][f"timing/{k}"] for k in STAGES) for s in measured])
    # drift check: the ratio of each adjacent (A block, B block) pair, and the fastest steps
    pair_ratios = []
    for k in range(args.blocks):
        steps = measured[k * args.block_steps:(k + 1) * args.block_steps]
        pair_ratios.append(median([history["timing/step"][s] for s in steps]) / median([b_metrics[s]["timing/step"] for s in steps]))
    a_r1, b_r1 = history["reward/mean"].get(1), b_metrics[1]["reward/mean"]
    return {
        "measured": measured, "a": a, "b": b, "ratio": a["step"] / b["step"], "pair_ratios": pair_ratios,
        "wall_a": median(blocks.walls["A"]), "wall_b": median(blocks.walls["B"]),
        "a_min": min(a_series("timing/step")), "b_min": min(b_series("timing/step")),
        "a_steps": a_series("timing/step"), "b_steps": b_series("timing/step"),
        "cpu": {"a": blocks.cpu_median("A"), "b": blocks.cpu_median("B")},
        "a_r1": a_r1, "b_r1": b_r1,
        "a_gap": max(history["rollout/logp_gap"].values()) if history["rollout/logp_gap"] else float("nan"),
        "b_gap": max(m["rollout/logp_gap"] for m in b_metrics.values()),
        "a_last_reward": history["reward/mean"].get(total, float("nan")), "b_last_reward": b_metrics[total]["reward/mean"],
    }


def print_report(args, recipe, run: dict[str, Any], st: dict[str, Any], total: int, load: tuple[float, float]) -> None:
    a, b, cpu = st["a"], st["b"], st["cpu"]
    wall_a, wall_b = st["wall_a"], st["wall_b"]
    rows = [
        ("rollout  (timing/rollout)", a["rollout"], b["rollout"]),
        ("reward   (timing/reward)", a["reward"], b["reward"]),
        ("train    (timing/train)", a["train"], b["train"]),
        ("  of which worker compute (timing/train_step)", a["train_step"], float("nan"), False),
        ("other    (step - the three)", a["other"], b["other"], False),
        ("STEP     (timing/step)", a["step"], b["step"]),
        ("wall/step incl. logging, images, ckpt (block medians)", wall_a, wall_b),
        ("CPU-s/step, driver + Ray processes (block medians)", cpu["a"][0] + cpu["a"][1], cpu["b"][0] + cpu["b"][1]),
        ("  of which Ray processes (for B: the idle trainer)", cpu["a"][1], cpu["b"][1], False),
    ]
    print()
    print(f"SD3 Flow-GRPO overhead: {run['samples']} samples/step ({recipe.trainer.prompts_per_step} prompts x "
          f"{recipe.algorithm.group_size}), {recipe.pipeline.num_inference_steps} SDE steps, "
          f"{recipe.pipeline.height}x{recipe.pipeline.width}; A = DiffusionTrainer ({args.workers} Ray Train workers), "
          f"B = bare loop (torch threads {torch.get_num_threads()}, thread niceness {run['bare_nice']})")
    print(f"warm-up {args.warmup} steps each, then {args.blocks} blocks x {args.block_steps} steps, "
          f"order {' '.join(run['blocks'].order)}; medians over {len(st['measured'])} measured steps per side")
    width = max(len(r[0]) for r in rows)
    cells = []
    for name, va, vb, *show in rows:
        r = va / vb if (show or [True])[0] and np.isfinite(va) and np.isfinite(vb) and vb > 0 else float("nan")
        cells.append([name, _fmt(va, "s"), _fmt(vb, "s"), _fmt(r)])
    print_table(["seconds per RL step (median)", "A trainer", "B bare", "A/B"], cells, [width, 10, 11, 9], gap=0)
    print(f"RATIO A/B (timing/step medians) = {st['ratio']:.2f}x   (wall/step: {wall_a / wall_b:.2f}x)")
    print(f"per block pair A/B: {' '.join(f'{r:.2f}' for r in st['pair_ratios'])} (median {median(st['pair_ratios']):.2f}); "
          f"fastest step: A {st['a_min']:.3f}s, B {st['b_min']:.3f}s, ratio {st['a_min'] / st['b_min']:.2f}x")
    print(f"1-min load average: {load[0]:.1f} at start, {load[1]:.1f} at end ({os.cpu_count()} CPUs)")
    print(f"checks: step-1 reward A {st['a_r1']:.6f} vs B {st['b_r1']:.6f} (same weights, prompts, seeds); "
          f"max first-pass |logp - logp_old|: A {st['a_gap']:.2e}, B {st['b_gap']:.2e}; "
          f"reward step 1 -> {total}: A {st['a_r1']:.4f} -> {st['a_last_reward']:.4f}, "
          f"B {st['b_r1']:.4f} -> {st['b_last_reward']:.4f}")


def result_of(args, run: dict[str, Any], st: dict[str, Any], load: tuple[float, float], t_all: float) -> dict[str, Any]:
    a, b, cpu = st["a"], st["b"], st["cpu"]
    return {
        "bench": "sd3_flowgrpo_overhead",
        "recipe": os.path.relpath(args.recipe, REPO) if str(args.recipe).startswith(str(REPO)) else args.recipe,
        "overrides": args.overrides,
        "workers": args.workers,
        "samples_per_step": run["samples"],
        "warmup_steps": args.warmup,
        "blocks": args.blocks,
        "block_steps": args.block_steps,
        "measured_steps_per_side": len(st["measured"]),
        "ratio_step": st["ratio"],
        "ratio_wall": st["wall_a"] / st["wall_b"],
        "ratio_block_pairs": st["pair_ratios"],
        "ratio_min_step": st["a_min"] / st["b_min"],
        "a": {
            "step_median_s": a["step"],
            "step_min_s": st["a_min"],
            "stages_median_s": {k: a[k] for k in STAGES} | {"train_worker_compute": a["train_step"], "other": a["other"]},
            "wall_per_step_median_s": st["wall_a"],
            "cpu_s_per_step_median": {"driver": cpu["a"][0], "ray_cluster": cpu["a"][1]},
            "setup_s": run["setup_s"],
            "step_s": st["a_steps"],
        },
        "b": {
            "step_median_s": b["step"],
            "step_min_s": st["b_min"],
            "stages_median_s": {k: b[k] for k in STAGES} | {"other": b["other"]},
            "wall_per_step_median_s": st["wall_b"],
            "cpu_s_per_step_median": {"driver": cpu["b"][0], "ray_cluster_idle": cpu["b"][1]},
            "torch_threads": torch.get_num_threads(),
            "thread_niceness": run["bare_nice"],
            "step_s": st["b_steps"],
        },
        "checks": {"a_step1_reward": st["a_r1"], "b_step1_reward": st["b_r1"], "a_max_logp_gap": st["a_gap"],
                   "b_max_logp_gap": st["b_gap"]},
        "total_wall_s": time.perf_counter() - t_all,
        "loadavg_1min": {"start": load[0], "end": load[1]},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=os.environ.get("UNIRL_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")

    from unirl_ray.config.recipe import load_recipe

    t_all = time.perf_counter()
    storage = tempfile.mkdtemp(prefix="unirl_bench_overhead_")
    total = args.warmup + args.blocks * args.block_steps
    overrides = [
        "trainer.run_name=bench-overhead",
        f"trainer.storage_path={storage}",
        f"trainer.num_steps={total}",
        f"ray.scaling.num_workers={args.workers}",
        "tracking.experiment_name=bench-overhead",
        *args.overrides,
    ]
    recipe = load_recipe(args.recipe, overrides)
    if args.bare_threads:
        torch.set_num_threads(args.bare_threads)
    load_start = os.getloadavg()[0]
    try:
        run = run_sides(args, recipe, total, storage)
    finally:
        shutdown_ray()
        if not args.keep_storage:
            shutil.rmtree(storage, ignore_errors=True)
    st = summarise(args, run, total)
    load = (load_start, os.getloadavg()[0])
    print_report(args, recipe, run, st, total, load)
    emit_json(result_of(args, run, st, load, t_all), args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
