"""One unified train step (text + image loss, one optimizer step) vs the two stages as two separate steps.

A benchmark, not a test: it asserts nothing about speed. One batch of the tiny unified recipe
(``recipes/unified/tiny/unified_tiny.yaml``: text segments written and images drawn once, scored by
brightness + the fraction of "a", credit assigned once) is trained on, in alternating blocks, by:

  unified   ``UnifiedModelTrainStack`` over {text: GRPO, image: Flow-GRPO}: both losses, one backward pass
            per micro-batch of each stage, ONE optimizer step (clip + AdamW) per train step;
  separate  two ``TrainStack``s on two copies of the model from the same weights: GRPO on the distinct text
            segments, then Flow-GRPO on the images, each with its own optimizer step (what training the
            two stages as two steps costs).

One process, no process group, no Ray (the module is used unwrapped, as a single-rank float32 run
does). Reported: median seconds per step of each, and ``unified / separate`` (at most 1.0x is the goal:
one optimizer step should not cost more than two).

    python bench/unified_step.py                     # ~1 min on 2 busy cores
    python bench/unified_step.py --steps 40 --json-out /tmp/unified.json
    python bench/unified_step.py trainer.prompts_per_step=4 pipeline.num_inference_steps=6   # recipe overrides
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from _common import cpu_seconds, emit_json, fmt_num, median, offline_env, print_table  # noqa: E402

offline_env()

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "unified" / "tiny" / "unified_tiny.yaml"


def batch_and_worker(overrides: list[str]):
    """A real rank built from the recipe, and one scored, credited batch it generated."""
    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.core.sample import TextPart, routed_part
    from unirl_ray.rewards.image import brightness
    from unirl_ray.rewards.text import char_fraction
    from unirl_ray.train.configs import TrainTopology
    from unirl_ray.train.rank import StackWorker
    from unirl_ray.trainer.unified import UnifiedModelTrainer

    trainer = UnifiedModelTrainer(load_recipe(str(RECIPE), ["ray.scaling.num_workers=1", *overrides]))
    worker = StackWorker(trainer.rank_sections(), topology=TrainTopology(), device=torch.device("cpu"))
    rows = [{"prompt": p} for p in ("a red fox", "an owl", "a cat", "a whale")[: trainer.prompts_per_step]]
    samples = worker.rollout.generate(trainer.make_requests(1, rows), policy_version=0)
    texts = [routed_part(s, TextPart, "text").text for s in samples]
    for s, b, a in zip(samples, brightness(images=[s.image for s in samples], prompts=texts),
                       char_fraction(completions=texts, char="a")):
        s.reward = b + 0.5 * a
    trainer.make_credit().assign(samples)
    return worker, samples


def separate_stacks(worker):
    """Two single-stage TrainStacks, each on its own copy of the model (same initial weights)."""
    from unirl_ray.train.backend.fsdp import FSDPBackend
    from unirl_ray.train.configs import TrainTopology
    from unirl_ray.train.stack import TrainStack

    stacks = {}
    for stage, algorithm in worker.algorithm.items():
        bundle = copy.copy(worker.bundle)
        bundle.transformer = copy.deepcopy(worker.bundle.transformer)
        backend = FSDPBackend(block_class_names=worker.backend.block_class_names, trainable_attr="transformer",
                              optimizer_cfg=worker.backend.optimizer_cfg, bundle=bundle)
        stacks[stage] = TrainStack(micro_batch_size=worker.stack.cfg.micro_batch_size, fsdp_backend=backend,
                                   algorithm=algorithm, max_grad_norm=worker.stack.cfg.max_grad_norm)
        backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
    return stacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per configuration")
    parser.add_argument("--blocks", type=int, default=6, help="interleaved blocks the steps are split into")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json-out", default=None)
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    from unirl_ray.train.stack import distinct_parts

    worker, samples = batch_and_worker(overrides)
    stacks = separate_stacks(worker)
    text_batch = distinct_parts(samples, worker.algorithm["text"].part_of)
    runs = {
        "unified": lambda seed: worker.stack.train(samples, seed=seed),
        "separate": lambda seed: (stacks["text"].train(text_batch, seed=seed), stacks["image"].train(samples, seed=seed)),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, float] = dict.fromkeys(runs, 0.0)
    for name, run in runs.items():  # warm-up
        run(0)
    per_block = max(1, args.steps // args.blocks)
    for block in range(args.blocks):
        for name in (list(runs) if block % 2 == 0 else list(runs)[::-1]):
            c0 = cpu_seconds()[0]
            for i in range(per_block):
                t0 = time.perf_counter()
                runs[name](block * per_block + i + 1)
                times[name].append(time.perf_counter() - t0)
            cpu[name] += cpu_seconds()[0] - c0
    med = {name: median(v) for name, v in times.items()}
    ratio = med["unified"] / med["separate"]
    print(f"batch: {len(text_batch)} text segments, {len(samples)} images; {per_block * args.blocks} steps each, "
          f"{args.blocks} interleaved blocks, {args.threads} torch thread(s)")
    print_table(["config", "median s/step", "CPU-s/step"],
                [[name, fmt_num(med[name], 9, 4), fmt_num(cpu[name] / len(times[name]), 9, 4)] for name in runs],
                [10, 14, 11])
    print(f"unified / separate: {ratio:.2f}x (median seconds); CPU-s {cpu['unified'] / cpu['separate']:.2f}x")
    emit_json({"bench": "unified_step", "median_s": med, "ratio_unified_over_separate": ratio,
               "cpu_s_per_step": {k: cpu[k] / len(times[k]) for k in runs}, "overrides": overrides,
               "text_segments": len(text_batch), "images": len(samples)}, args.json_out)


if __name__ == "__main__":
    main()
