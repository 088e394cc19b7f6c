"""What checkpoints cost the training: the tiny AR recipe with ``checkpoint_every=N`` (``--every``) against none.

A benchmark, not a test: it asserts nothing about speed. Three real AR trainers (``char_grpo_direct.yaml``,
one Ray Train worker each, on one local Ray) run in interleaved blocks, so a change in the machine's load
hits every side alike:

  none    no checkpoint in the measured steps;
  async   a checkpoint every ``--every`` steps, ``ray.async_checkpoint=true`` (the default): the save returns
          once the rank has copied its shards to memory (and the previous checkpoint is committed); a
          thread writes them, copies them into the run's storage and commits the folder;
  sync    a checkpoint every ``--every`` steps, ``ray.async_checkpoint=false``: every save is written, stored
          and committed before the step goes on.

Per side: the median wall seconds per step (the step, its MLflow logging and its checkpoint, as ``fit``
runs them), its ratio to ``none``, and the medians of the save's phases as the step saw them (``write``: the
DCP shards written into the run's storage folder, for async the copy to memory only; ``report``: the state
file, the ranks' agreement and the commit marker, for async in the background; ``commit``: waiting for the
previous asynchronous checkpoint's commit).

    python bench/checkpoint_cost.py                       # every step; 3 blocks of 5 steps per side, after 2 warm-up
    python bench/checkpoint_cost.py --every 10 --block-steps 10 --json-out /tmp/ckpt.json
    python bench/checkpoint_cost.py --every 5 --block-steps 5 '+bundle.config.tiny={_target_: unirl_ray.models.causal_lm.TinyLMConfig, hidden_size: 512, num_layers: 8,
        num_attention_heads: 8, intermediate_size: 2048}'   # a ~27M-parameter model: 0.3 GB of state per checkpoint

See bench/README.md for the figures and what they say.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _common import (DrivenTrainer, Interleave, close_all, finish_report, fmt_num, loadavg_1min, median,  # noqa: E402
                     offline_env, print_table, shutdown_ray)

RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "ar" / "tiny" / "char_grpo_direct.yaml")
SIDES = {"none": None, "async": True, "sync": False}


def runner(side: str, steps: int, storage: str, every: int, extra: list[str]) -> DrivenTrainer:
    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.trainer.ar import ARTrainer

    asynchronous = SIDES[side]
    overrides = [f"trainer.storage_path={storage}", f"trainer.run_name=ckpt-{side}", f"trainer.num_steps={steps}",
                 f"trainer.checkpoint_every={every if asynchronous is not None else 100_000}",
                 "tracking.log_samples_every=0", "tracking.experiment_name=bench-checkpoint",
                 "ray.scaling.num_workers=1", "ray.scaling.resources_per_worker.CPU=2", *extra]
    if asynchronous is not None:
        overrides.append(f"++ray.async_checkpoint={str(asynchronous).lower()}")

    def on_step(step: int, metrics: dict, times: dict) -> dict:
        return {"wall_s": times["wall_s"], "checkpoint_s": times["checkpoint_s"]}

    trainer = ARTrainer(load_recipe(RECIPE, overrides))
    # checkpoint_steps: checkpoints as fit takes them (every checkpoint_every steps); none's never fall due
    return DrivenTrainer(trainer, on_step=on_step, checkpoint_steps=None if asynchronous is None else 10**9,
                         quiet_teardown=True)


def save_phases(trainer, steps: list[int]) -> dict[str, float]:
    """Medians of the logged save phases over ``steps`` (from the run's MLflow metrics)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(trainer.tracker.tracking_uri)
    out = {}
    for key in ("write_s", "report_s", "commit_wait_s"):
        values = {m.step: m.value for m in client.get_metric_history(trainer.tracker.run_id, f"checkpoint/{key}")}
        out[key] = median([values[s] for s in steps if s in values])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--every", type=int, default=1, help="trainer.checkpoint_every of the async and sync sides")
    parser.add_argument("--json-out")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every side (key=value), e.g. a bigger model")
    args = parser.parse_args(argv)
    offline_env()
    load_start, t_all = loadavg_1min(), time.perf_counter()
    steps = args.warmup + args.blocks * args.block_steps
    runners: dict[str, DrivenTrainer] = {}
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as storage:
        try:
            for side in SIDES:
                runners[side] = runner(side, steps, storage, args.every, args.overrides)
                runners[side].setup()
            plan = Interleave(SIDES)
            for side, run in runners.items():
                plan.run(side, args.warmup, run.run_block, measured=False)
            for b in range(args.blocks):
                order = list(SIDES) if b % 2 == 0 else list(SIDES)[::-1]
                for side in order:
                    plan.run(side, args.block_steps, runners[side].run_block, measured=True)
            for run in runners.values():
                run.finish()
            measured = list(range(args.warmup + 1, steps + 1))
            result: dict = {"order": plan.order, "sides": {}}
            base = median(plan.walls["none"])
            rows = []
            for side, run in runners.items():
                per_step = median(plan.walls[side])
                ckpt = median([run.steps[s]["checkpoint_s"] for s in measured])  # NaN (no save) is dropped
                phases = save_phases(run.trainer, measured) if SIDES[side] is not None else {}
                result["sides"][side] = {"wall_per_step_s": per_step, "block_walls": plan.walls[side],
                                         "ratio_to_none": per_step / base, "checkpoint_s": ckpt, **phases}
                spread = f"{min(plan.walls[side]):.3f}-{max(plan.walls[side]):.3f}"
                rows.append([side, fmt_num(per_step, 7, 3), spread, fmt_num(per_step / base, 5, 2),
                             fmt_num(ckpt, 6, 3), *(fmt_num(phases.get(k), 6, 3)
                                                     for k in ("write_s", "report_s", "commit_wait_s"))])
        finally:
            close_all(runners)
            shutdown_ray()
    print(f"\nmedian wall seconds per step over {args.blocks} blocks of {args.block_steps} steps per side "
          f"(interleaved: {' '.join(plan.order)})")
    print_table(["side", "step_s", "blocks", "ratio", "ckpt_s", "write", "report", "commit"], rows,
                [6, 7, 13, 5, 6, 6, 6, 6])
    finish_report(result, load_start, t_all, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
