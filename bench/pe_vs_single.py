"""A prompt-enhancer step against an AR step plus a diffusion step of the same sizes, through the existing
trainers, in one run, interleaved.

A benchmark, not a test: it asserts nothing about speed. Three real trainers in one embedded Ray
(``ray.init(num_cpus=8)``: the three worker groups stay up side by side), each with the same workers:

  pe         ``PETrainer`` on ``recipes/pe/tiny/pe_tiny.yaml`` (both sides trained): P prompts, N rewrites
             each (tiny LM), M images per rewrite (tiny SD3);
  ar         ``ARTrainer`` on ``recipes/ar/tiny/char_grpo_direct.yaml`` made the PE rewriter's size: the same
             LM, pipeline, optimizer and stack, P prompts x N samples, the length reward;
  diffusion  ``DiffusionTrainer`` on ``recipes/diffusion/sd3/sd3_tiny_flowgrpo.yaml`` made the PE image side's
             size: the same SD3, pipeline, optimizer and stack, P x N prompts x M images, brightness.

After one unmeasured warm-up block each, the sides run ``--blocks`` blocks of ``--block-steps`` steps in
turn (pe, ar, diffusion, pe, ...); the figure is the median over blocks of the wall seconds per step,
and the ratio is pe / (ar + diffusion): what composing the two sides on one rank costs over running
them as two trainers (the rewrite cleaning, the composed Samples, routing and the advantage check).
The PE side has one reward app for both kinds of reward, the two others one each.

    python bench/pe_vs_single.py                       # ~3 min on 2 cores
    python bench/pe_vs_single.py --blocks 6 --block-steps 2 --json-out /tmp/pe.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from _common import (  # noqa: E402  (bench/ is on sys.path when run as a script)
    DrivenTrainer, Interleave, close_all, finish_report, fmt_num, loadavg_1min, median, offline_env, pick,
    print_table, shutdown_ray,
)

offline_env()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RECIPES = {"pe": REPO / "recipes" / "pe" / "tiny" / "pe_tiny.yaml",
           "ar": REPO / "recipes" / "ar" / "tiny" / "char_grpo_direct.yaml",
           "diffusion": REPO / "recipes" / "diffusion" / "sd3" / "sd3_tiny_flowgrpo.yaml"}
KEPT = ("reward/mean", "timing/step", "timing/rollout", "timing/train", "timing/reward")


def matched_recipes(storage: str, steps: int, workers: int):
    """The three recipes, the single-side ones cut to the PE sides' sizes (read from the PE recipe)."""
    from omegaconf import OmegaConf

    from unirl_ray.config.recipe import load_recipe

    def load(side: str, *overrides: str):
        return load_recipe(str(RECIPES[side]), [
            f"trainer.run_name=bench-{side}", f"trainer.storage_path={storage}", f"trainer.num_steps={steps}",
            "trainer.checkpoint_every=1000000", "tracking.log_samples_every=0", "tracking.experiment_name=bench-pe",
            f"ray.scaling.num_workers={workers}", *overrides])

    pe = load("pe")
    prompts, n = int(pe.trainer.prompts_per_step), int(pe.ar.algorithm.group_size)
    m = int(pe.diffusion.algorithm.group_size)

    ar = load("ar", f"trainer.prompts_per_step={prompts}")
    diffusion = load("diffusion", f"trainer.prompts_per_step={prompts * n}")
    for single, side in ((ar, "ar"), (diffusion, "diffusion")):
        for section in ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout"):
            single[section] = OmegaConf.create(OmegaConf.to_container(pe[side][section], resolve=True))
        single.data = OmegaConf.create(OmegaConf.to_container(pe.data, resolve=True))  # the same prompts
    ar.reward.rewards = {"length": OmegaConf.to_container(pe.reward.rewards.length)}
    diffusion.reward.rewards = {"brightness": OmegaConf.to_container(pe.reward.rewards.brightness)}
    return {"pe": pe, "ar": ar, "diffusion": diffusion}, (prompts, n, m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import ray

    from unirl_ray.trainer.ar import ARTrainer
    from unirl_ray.trainer.diffusion import DiffusionTrainer
    from unirl_ray.trainer.pe import PETrainer

    t_all, load_start = time.perf_counter(), loadavg_1min()
    steps = (args.blocks + 1) * args.block_steps
    storage = tempfile.mkdtemp(prefix="bench-pe-")
    recipes, (prompts, n, m) = matched_recipes(storage, steps, args.workers)
    ray.init(num_cpus=8, include_dashboard=False, logging_level=logging.WARNING)
    classes = {"pe": PETrainer, "ar": ARTrainer, "diffusion": DiffusionTrainer}
    sides: dict[str, DrivenTrainer] = {}
    setup_s = {}
    try:
        for side, recipe in recipes.items():
            print(f"[bench] setting up {side} ...", flush=True)
            sides[side] = DrivenTrainer(classes[side](recipe), on_step=pick(KEPT), quiet_teardown=True)
            setup_s[side] = sides[side].setup()
        interleave = Interleave(list(sides))
        for block in range(args.blocks + 1):
            for side, runner in sides.items():
                interleave.run(side, args.block_steps, runner.run_block, measured=block > 0)
            print(f"[bench] block {block}/{args.blocks} done", flush=True)
        for runner in sides.values():
            runner.finish()
    finally:
        close_all(sides)
        shutdown_ray()

    per_step = {side: median(interleave.walls[side]) for side in sides}
    parts = {side: {k.split("/", 1)[1]: median([runner.steps[s][k] for s in range(args.block_steps + 1, steps + 1)])
                    for k in KEPT if k.startswith("timing/")} for side, runner in sides.items()}
    ratio = per_step["pe"] / (per_step["ar"] + per_step["diffusion"])
    block_ratios = [p / (a + d) for p, a, d in zip(interleave.walls["pe"], interleave.walls["ar"], interleave.walls["diffusion"])]
    print()
    print(f"PE step vs AR step + diffusion step of the same sizes: {prompts} prompts x {n} rewrites x {m} images; "
          f"{args.workers} Ray Train workers each; medians over {args.blocks} blocks of {args.block_steps} steps "
          f"(order {' '.join(interleave.order)})")
    rows = [[side, fmt_num(per_step[side]), fmt_num(parts[side]["rollout"]), fmt_num(parts[side]["reward"]),
             fmt_num(parts[side]["train"]), fmt_num(setup_s[side], 6, 1)] for side in sides]
    rows.append(["ar + diffusion", fmt_num(per_step["ar"] + per_step["diffusion"]), *(
        fmt_num(parts["ar"][k] + parts["diffusion"][k]) for k in ("rollout", "reward", "train")), ""])
    print_table(["side", "step s", "rollout", "reward", "train", "setup"], rows, [16, 7, 7, 7, 7, 6])
    print(f"ratio pe / (ar + diffusion): {ratio:.3f} (target <= 1.15); per block: "
          + ", ".join(f"{r:.3f}" for r in block_ratios))
    finish_report({"per_step_s": per_step, "timings_s": parts, "setup_s": setup_s, "ratio": ratio,
                   "block_ratios": block_ratios, "sizes": {"prompts": prompts, "rewrites": n, "images": m},
                   "order": interleave.order, "workers": args.workers}, load_start, t_all, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
