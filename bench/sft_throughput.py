"""SFT throughput on a tiny causal LM: the SFT trainer vs. a bare single-process loop vs. TRL's SFTTrainer.

A benchmark, not a test: it asserts nothing about speed. One process trains copies of the same tiny
demo LM (the Qwen2-shaped ``CausalLMBundle`` demo model, identical initial weights) on the same chat
records (``recipes/sft/tiny/char_chat_sft.yaml``: 32 conversations, written ``--repeat`` times over
into one file, loss on assistant tokens), with the same batch (``trainer.batch_size`` records per
optimizer step), the same ``max_length`` and the same AdamW / clipping settings:

  (A) ``SFTTrainer``: Ray Train workers (FSDP2 over gloo when there are several) reading their Ray
      Data shards, the ``sft_train`` command (``trainer.steps_per_call`` steps per call), MLflow
      logging of every step (a fresh SQLite store in a temporary storage path);
  (B) a bare single-process PyTorch loop: the same records, parsed and tokenised in the step with the
      trainer's own record -> tokens builder (as a real loop over a JSON-lines file), micro-batches
      of ``stack.micro_batch_size x workers`` rows, token-mean cross-entropy, gradient clipping,
      ``torch.optim.AdamW``. No Ray, no FSDP, no MLflow;
  (C) TRL's ``SFTTrainer`` (``pip install -e .[bench]``) on the same conversations, in a thread of
      this process that is paused between blocks (its own tokenisation and collator; it trains on
      every token of the conversation, which costs the same per token);
  (D) the trainer's rank-side code in this process, without Ray and without FSDP2 (``StackWorker``
      with no process group + ``SFTFeed`` over the file's lines): what records -> rows -> TrainStack
      cost over B, apart from FSDP2 and the Ray command.

After warm-up (excluded), alternating blocks A, B, C, D, A, B, C, D, ... It prints the median
seconds per step and the median tokens per second of each side (tokens = non-padding tokens of the
step's batch), the ratios A/B, C/B and D/B of the median step times, and where A's step goes.

    python bench/sft_throughput.py                           # ~1-2 min on 2 busy cores
    python bench/sft_throughput.py --sides ABD --workers 1 --threads 1   # one worker vs one-thread loops
    python bench/sft_throughput.py --width 256 --layers 4    # a bigger (still random) demo model
    python bench/sft_throughput.py --json-out /tmp/sft_throughput.json trainer.steps_per_call=16

See bench/README.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _common import (  # noqa: E402  (bench/ is on sys.path when run as a script)
    DrivenTrainer, GatedLoop, Interleave, StepGate, close_all, trl_available,
    emit_json, median, offline_env, print_table,
)

offline_env()

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "sft" / "tiny" / "char_chat_sft.yaml"
SIDE_NAMES = {"A": "unirl_ray SFTTrainer", "B": "bare PyTorch loop", "C": "TRL SFTTrainer",
              "D": "SFTFeed+TrainStack, 1 proc"}


def load(args: argparse.Namespace, data_path: str | None = None):
    from unirl_ray.config.recipe import load_recipe

    overrides = [f"ray.scaling.num_workers={args.workers}", "data.eval_fraction=0.0", "trainer.eval_every=0",
                 "trainer.eval_on_start=false", "trainer.checkpoint_every=1000000", *args.overrides]
    if data_path:
        overrides.append(f"data.path={data_path}")
    if args.width:
        overrides.append("+bundle.config.tiny={_target_: unirl_ray.models.causal_lm.TinyLMConfig, "
                         f"hidden_size: {args.width}, num_layers: {args.layers}, intermediate_size: {2 * args.width}}}")
    return load_recipe(args.recipe, overrides)


# ------------------------------------------------------------------------------------------------ (A)
def trainer_side(recipe, total_steps: int, storage: str) -> DrivenTrainer:
    """The real ``SFTTrainer``: ``setup`` (Ray, workers, MLflow), then ``train_steps`` calls
    (``trainer.steps_per_call`` steps per command), every step logged."""
    from omegaconf import OmegaConf

    from unirl_ray.trainer.sft import SFTTrainer

    recipe = OmegaConf.merge(recipe, {"trainer": {"num_steps": total_steps, "storage_path": storage,
                                                  "run_name": "bench-sft"}})
    trainer = SFTTrainer(recipe)
    return DrivenTrainer(trainer, on_step=_trainer_record, per_call=trainer.run_cfg.steps_per_call)


def _trainer_record(step: int, metrics: dict, times: dict) -> dict[str, float]:
    return {"time": metrics["timing/train"], "tokens": metrics["data/tokens"], "loss": metrics["train/loss"],
            "stack": metrics["timing/train_step"], "data": metrics["timing/data"]}


# ------------------------------------------------------------------------------------------------ (B)
class BareSide:
    """One process, plain torch, the same examples, micro-batches, loss, clipping and AdamW."""

    def __init__(self, recipe, workers: int) -> None:
        from unirl_ray.algorithms.sft import collate_text
        from unirl_ray.config.recipe import instantiate

        torch.manual_seed(int(recipe.trainer.seed))  # what every train worker does before building
        self.bundle = instantiate(recipe.bundle)
        pipeline = instantiate(recipe.pipeline, bundle=self.bundle)
        source = instantiate(recipe.data)
        self.build = source.builder(bundle=self.bundle, pipeline=pipeline)
        with open(source.files[0]) as f:
            self.lines = [line for line in f.read().splitlines() if line.strip()]
        self.collate = collate_text
        self.pad = int(self.bundle.tokenizer.pad_token_id)
        self.batch = int(recipe.trainer.batch_size)
        self.micro = int(recipe.stack.micro_batch_size) * workers  # rows per forward: the ranks' together
        self.max_grad_norm = recipe.stack.max_grad_norm
        opt = recipe.backend.optimizer_cfg
        model = self.bundle.model
        model.requires_grad_(True)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": float(opt.get("weight_decay", 0.0))}, {"params": rest, "weight_decay": 0.0}],
            lr=float(opt.learning_rate), betas=tuple(opt.get("betas", (0.9, 0.999))), eps=float(opt.get("eps", 1e-8)),
            fused=bool(opt.get("fused", True)))
        self.generator = torch.Generator().manual_seed(0)
        self.order: list[int] = []
        self.steps: list[dict[str, float]] = []

    def _next_batch(self) -> list:
        """The next records, parsed and tokenised here, inside the timed step, as the trainer does."""
        out = []
        while len(out) < self.batch:
            if not self.order:
                self.order = torch.randperm(len(self.lines), generator=self.generator).tolist()
            out.append(self.build.build(json.loads(self.lines[self.order.pop()])))
        return out

    def run_block(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.steps.append(self.step())
        return time.perf_counter() - t0

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        rows = self._next_batch()
        total = sum(p.num_targets for p in rows)
        loss_sum = 0.0
        model = self.bundle.model
        for start in range(0, len(rows), self.micro):
            batch = self.collate(rows[start : start + self.micro], self.pad)
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), batch["input_ids"][:, 1:],
                                                    reduction="none")
            loss = (nll * batch["target_mask"]).sum()
            (loss / total).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"time": time.perf_counter() - t0, "tokens": float(sum(len(p.input_ids) for p in rows)),
                "loss": loss_sum / total}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ (D)
class FeedSide:
    """The trainer's rank-side code in this process without Ray or FSDP2: ``StackWorker`` (bundle,
    pipeline, backend without a process group, SFT, TrainStack) and its ``SFTFeed`` over the file's
    lines, one rank taking the whole batch. What the SFT code path costs over B, apart from FSDP2."""

    def __init__(self, recipe, workers: int) -> None:
        from omegaconf import OmegaConf

        from unirl_ray.config.recipe import instantiate
        from unirl_ray.train.rank import StackWorker
        from unirl_ray.train.configs import TrainTopology

        source = instantiate(recipe.data)
        sections = {n: OmegaConf.to_container(recipe[n], resolve=True)
                    for n in ("bundle", "pipeline", "backend", "algorithm", "stack")}
        sections["stack"]["micro_batch_size"] *= workers  # rows per forward: the ranks' together, as B
        torch.manual_seed(int(recipe.trainer.seed))
        with open(source.files[0]) as f:
            lines = [{"text": line, "path": source.files[0]} for line in f.read().splitlines() if line.strip()]
        shards = {"train": lambda: iter(lines)}
        self.worker = StackWorker(sections, topology=TrainTopology(), device=torch.device("cpu"), open_shard=shards.get)
        self.worker.sft_start(source=source, records_per_rank=int(recipe.trainer.batch_size), cursor={"epoch": 0, "offset": 0})
        self.seed = 0
        self.steps: list[dict[str, float]] = []

    def run_block(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            (result,) = self.worker.sft_train([self.seed])
            self.seed += 1
            self.steps.append({"time": time.perf_counter() - t, "tokens": float(result["tokens"]),
                               "loss": result["metrics"]["train/loss"]})
        return time.perf_counter() - t0

    def close(self) -> None:
        self.worker.sft_feed.stream.close()


# ------------------------------------------------------------------------------------------------ (C)
class TRLSide:
    """TRL ``SFTTrainer`` on a fresh copy of the same model; ``train()`` runs in a thread held at every
    ``on_step_begin`` until the driver releases the next block. Step ``k`` lasts from its release to the
    next ``on_step_begin`` (batch, forward/backward, optimizer step, logging)."""

    def __init__(self, recipe, total_steps: int, out_dir: str) -> None:
        import transformers
        from datasets import Dataset
        from transformers import TrainerCallback
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl import SFTConfig, SFTTrainer

        from unirl_ray.config.recipe import instantiate

        transformers.logging.set_verbosity_error()
        warnings.filterwarnings("ignore", category=FutureWarning)
        torch.manual_seed(int(recipe.trainer.seed))
        bundle = instantiate(recipe.bundle)
        source = instantiate(recipe.data)
        with open(source.files[0]) as f:
            rows = [json.loads(line) for line in f.read().splitlines() if line.strip()]
        batch = int(recipe.trainer.batch_size)
        rows = rows * (1 + (total_steps + 2) * batch // len(rows))
        opt = recipe.backend.optimizer_cfg
        args = SFTConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, activation_checkpointing=False,
            seed=int(recipe.trainer.seed), max_steps=total_steps + 1, per_device_train_batch_size=batch,
            gradient_accumulation_steps=1, max_length=int(recipe.data.max_length), packing=False,
            learning_rate=float(opt.learning_rate), lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=float(opt.get("weight_decay", 0.0)),
            optim="adamw_torch_fused" if opt.get("fused", True) else "adamw_torch",
            max_grad_norm=float(recipe.stack.max_grad_norm or 0.0), logging_steps=1, save_strategy="no",
            report_to="none", disable_tqdm=True, dataloader_num_workers=0, dataset_num_proc=None,
        )
        side = self
        self.tokens: dict[int, float] = {}

        class Gate(StepGate, TrainerCallback):
            last_tokens = 0.0

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "num_tokens" in logs:
                    side.tokens[state.global_step] = float(logs["num_tokens"]) - self.last_tokens
                    self.last_tokens = float(logs["num_tokens"])

        self.gate = Gate()
        self.trainer = SFTTrainer(model=bundle.model, args=args, train_dataset=Dataset.from_list(rows),
                                  processing_class=bundle.tokenizer, callbacks=[self.gate])
        for cb in (PrinterCallback, ProgressCallback):
            self.trainer.remove_callback(cb)
        self.loop = GatedLoop(self.trainer.train, self.gate, "trl-sft")
        self.done = 0
        self.steps: list[dict[str, float]] = []

    def setup(self) -> None:
        self.loop.start()

    def run_block(self, n: int) -> float:
        wall = self.loop.release(n)
        for k in range(self.done + 1, self.done + n + 1):
            self.steps.append({"time": self.loop.step_s(k),
                               "tokens": self.tokens.get(k, float("nan")), "loss": float("nan")})
        self.done += n
        return wall

    def close(self) -> None:
        self.loop.close()


# ---------------------------------------------------------------------------------------------- driver
def repeated_records(recipe, times: int, folder: str) -> str:
    """The recipe's record file written ``times`` times over into ``folder`` (a realistic epoch length)."""
    from unirl_ray.config.recipe import instantiate

    source = instantiate(recipe.data)
    with open(source.files[0]) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    path = os.path.join(folder, "records.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines * times) + "\n")
    return path


def summarise(steps: list[dict[str, float]] | dict[int, dict[str, float]], warmup: int) -> dict[str, float]:
    """Medians after the warm-up of a side's step records (a list, or the trainer's ``{step: record}``)."""
    if isinstance(steps, dict):
        steps = list(steps.values())  # in step order
    measured = steps[warmup:]
    return {
        "steps": len(measured),
        "s_per_step": median([s["time"] for s in measured]),
        "tokens_per_s": median([s["tokens"] / s["time"] for s in measured]),
        "tokens_per_step": median([s["tokens"] for s in measured]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    parser.add_argument("--sides", default="ABCD",
                        help="which of A (trainer), B (bare loop), C (TRL), D (the trainer's rank code in-process) to run")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers of the trainer")
    parser.add_argument("--warmup", type=int, default=8, help="steps per side excluded from the statistics")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-steps", type=int, default=16)
    parser.add_argument("--width", type=int, default=0, help="hidden size of a bigger demo model (0: the recipe's)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the bigger demo model (with --width)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of this process (B, C, D); 0: torch's default. Ray gives each worker 1")
    parser.add_argument("--repeat", type=int, default=64,
                        help="write the records this many times over into one file (every side reads it): an epoch of "
                             "32 records ends every 2-4 steps, and each new Ray Data epoch costs the trainer a new "
                             "streaming execution; 1 measures that small-data case")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("overrides", nargs="*", help="recipe key=value overrides (both sides)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    sides = [s for s in "ABCD" if s in args.sides.upper()]
    if "C" in sides:
        ok, why = trl_available()
        if not ok:
            print(f"skipping C: {why}")
            sides.remove("C")
    total = args.warmup + args.blocks * args.block_steps
    storage = tempfile.mkdtemp(prefix="unirl_bench_sft_")
    recipe = load(args)
    if args.repeat > 1:
        recipe = load(args, repeated_records(recipe, args.repeat, storage))
    runners = {}
    blocks = Interleave(sides)
    try:
        if "A" in sides:
            runners["A"] = trainer_side(recipe, total, storage)
            runners["A"].setup()
        if "B" in sides:
            runners["B"] = BareSide(recipe, args.workers)
        if "C" in sides:
            runners["C"] = TRLSide(recipe, total, os.path.join(storage, "trl"))
            runners["C"].setup()
        if "D" in sides:
            runners["D"] = FeedSide(recipe, args.workers)
        for side in sides:  # warm-up, excluded
            blocks.run(side, args.warmup, runners[side].run_block, measured=False)
        for _ in range(args.blocks):
            for side in sides:
                blocks.run(side, args.block_steps, runners[side].run_block, measured=True)
        if "A" in runners:
            runners["A"].finish()
    finally:
        close_all(runners)
        shutil.rmtree(storage, ignore_errors=True)
    walls = blocks.walls

    result = {s: {**summarise(runners[s].steps, args.warmup), "wall_s_per_step": median(walls[s])} for s in sides}
    if "A" in result:  # where the trainer's step goes: TrainStack.train on rank 0, and records -> rows
        measured = list(runners["A"].steps.values())[args.warmup:]
        result["A"]["stack_s_per_step"] = median([m["stack"] for m in measured])
        result["A"]["data_s_per_step"] = median([m["data"] for m in measured])
    print(f"\nSFT throughput, median over {args.blocks} x {args.block_steps} steps per side after {args.warmup} warm-up "
          f"steps ({platform.machine()}, {os.cpu_count()} cores, {args.workers} trainer worker(s), torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads in this process; the 32 records x {args.repeat})")
    print_table(["side", "s/step", "wall/step", "tokens/step", "tokens/s"],
                [[f"{s} {SIDE_NAMES[s]}", f"{result[s]['s_per_step']:.4f}", f"{result[s]['wall_s_per_step']:.4f}",
                  f"{result[s]['tokens_per_step']:.0f}", f"{result[s]['tokens_per_s']:.0f}"] for s in sides],
                [26, 8, 10, 12, 10])
    if "A" in result:
        a = result["A"]
        print(f"A split: TrainStack.train on rank 0 {a['stack_s_per_step']:.4f} s, records -> rows (max over ranks) "
              f"{a['data_s_per_step']:.4f} s, the rest (command round trip, metrics) "
              f"{a['s_per_step'] - a['stack_s_per_step'] - a['data_s_per_step']:.4f} s per step (medians)")
    if "B" in result:
        for s in (x for x in sides if x != "B"):
            ratio = result[s]["s_per_step"] / result["B"]["s_per_step"]
            tok = result["B"]["tokens_per_s"] / result[s]["tokens_per_s"]
            print(f"RATIO {s}/B: {ratio:.3f} (s/step), {tok:.3f} (B tokens/s over {s} tokens/s)")
            result[f"ratio_{s}_over_B"] = ratio
            result[f"tokens_per_s_ratio_B_over_{s}"] = tok
    emit_json({"bench": "sft_throughput", "workers": args.workers, "width": args.width or None, "repeat": args.repeat,
               "threads": torch.get_num_threads(), **result}, args.json_out, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
