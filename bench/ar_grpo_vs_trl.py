"""GRPO on a tiny causal LM, side by side: this trainer (direct / engine), TRL's GRPOTrainer, a bare loop.

A benchmark, not a test: it asserts nothing about speed. In one process and one run it trains four
copies of the same tiny demo LM (the Qwen2-shaped ``CausalLMBundle`` demo model with its char
tokenizer, identical initial weights) on the same task (the recipe's reward: the fraction of the
letter "a" in the completion), the same prompts in the same order, the same batch
(prompts_per_step x group_size completions of at most max_new_tokens tokens) and the same GRPO
hyperparameters:

  (A) ``ARTrainer`` on ``recipes/ar/tiny/char_grpo_direct.yaml``: Ray Train workers (FSDP2 over
      gloo) that generate with the module they train, the reward Serve app, Ray Data prompts,
      MLflow (a fresh SQLite store in a temporary storage path);
  (B) ``ARTrainer`` on ``recipes/ar/tiny/char_grpo_engine.yaml``: the same, but a dedicated HF
      rollout engine (a Ray Serve app) generates and receives verified weights after every step;
  (C) TRL's ``GRPOTrainer`` (``pip install -e .[bench]``), on CPU, HF ``generate``, in a thread of
      this process that is paused between blocks;
  (D) a bare single-process PyTorch loop: ``CausalLMPipeline.sample`` with the trainer's per-sample
      seeds, the reward function called inline, group advantages, the token-level clipped GRPO
      loss over micro-batches, gradient clipping, ``torch.optim.AdamW``. No Ray, no FSDP, no MLflow;

after warm-up, in alternating blocks A, B, C, D, A, B, C, D, ..., and prints the median seconds per
step of each side, the fixed per-step overhead of each side over D (in ms), and the first step at
which each side's batch-mean reward reached ``--threshold`` within the step budget (every side
runs ``warmup + blocks x block_steps`` steps).

    python bench/ar_grpo_vs_trl.py                       # all four, ~3-3.5 min on 2 busy cores
    python bench/ar_grpo_vs_trl.py --sides AD            # only the trainer (direct) vs. the bare loop
    python bench/ar_grpo_vs_trl.py --json-out /tmp/ar_vs_trl.json --threshold 0.6

See bench/README.md for what is measured, how the sides differ, and how to read it.
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
import warnings
from pathlib import Path
from typing import Any, Callable

from _common import (  # noqa: E402  (bench/ is on sys.path when run as a script)
    DrivenTrainer, GatedLoop, Interleave, StepGate, close_all, trl_available,
    shutdown_ray,
    emit_json, fmt_num, median, offline_env, print_table,
)

offline_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402


REPO = Path(__file__).resolve().parent.parent
DEFAULT_DIRECT = REPO / "recipes" / "ar" / "tiny" / "char_grpo_direct.yaml"
DEFAULT_ENGINE = REPO / "recipes" / "ar" / "tiny" / "char_grpo_engine.yaml"
SIDE_NAMES = {
    "A": "unirl_ray ARTrainer, direct rollout",
    "B": "unirl_ray ARTrainer, dedicated HF engine",
    "C": "TRL GRPOTrainer",
    "D": "bare PyTorch loop",
}
STAGES = ("rollout", "reward", "train", "sync")


def _fmt(x: float | None, width: int = 7, digits: int = 3) -> str:
    return fmt_num(x, width, digits)


# ---------------------------------------------------------------------------------------------
# what every side shares, read from the direct recipe


class Task:
    """Model, task and GRPO settings of the run, read from the (direct) recipe; the sides all use these."""

    def __init__(self, recipe) -> None:
        from unirl_ray.config.recipe import locate

        self.seed = int(recipe.trainer.seed)
        self.prompts_per_step = int(recipe.trainer.prompts_per_step)
        algo = recipe.algorithm
        self.algorithm = str(algo._target_).rsplit(".", 1)[-1]
        self.group_size = int(algo.group_size)
        self.clip_low = float(algo.get("clip_low", 0.2))
        self.clip_high = float(algo.get("clip_high", 0.2))
        self.normalize_std = bool(algo.get("normalize_std", True))
        unsupported = {
            "algorithm._target_": (self.algorithm, "GRPO"),
            "algorithm.advantage_estimator": (algo.get("advantage_estimator", "grpo"), "grpo"),
            "algorithm.loss_aggregation": (algo.get("loss_aggregation", "seq_mean_token_mean"), "seq_mean_token_mean"),
            "algorithm.kl_beta": (float(algo.get("kl_beta", 0.0)), 0.0),
            "algorithm.entropy_coef": (float(algo.get("entropy_coef", 0.0)), 0.0),
            "algorithm.dynamic_sampling": (bool(algo.get("dynamic_sampling", False)), False),
            "stack.num_updates_per_batch": (int(recipe.stack.get("num_updates_per_batch", 1)), 1),
            "backend.lora_cfg": (recipe.backend.get("lora_cfg"), None),
            "backend.lr_scheduler_cfg": (recipe.backend.get("lr_scheduler_cfg"), None),
            "pipeline.top_p": (float(recipe.pipeline.get("top_p", 1.0)), 1.0),
        }
        bad = {k: v for k, (v, want) in unsupported.items() if v != want}
        if bad:
            raise SystemExit(f"this benchmark compares plain GRPO (one update per batch, no KL, full fine-tuning, "
                             f"constant lr, top_p 1); the recipe sets {bad}")
        self.num_samples = self.prompts_per_step * self.group_size
        self.workers = int(recipe.ray.scaling.num_workers)
        self.rollout_micro = int(recipe.rollout.get("micro_batch_size", self.num_samples))
        self.micro = int(recipe.stack.micro_batch_size)
        mini = recipe.stack.get("mini_batch_size")
        # the trainer's mini-batch counts samples over all ranks, as the bare loop's does
        self.mini = self.num_samples if mini is None else min(self.num_samples, int(mini))
        if self.num_samples % self.mini or self.mini % self.micro:
            raise SystemExit(f"{self.num_samples} samples per step must split into mini-batches of {self.mini} "
                             f"and micro-batches of {self.micro}")
        self.max_grad_norm = recipe.stack.get("max_grad_norm")
        opt = recipe.backend.optimizer_cfg
        self.lr = float(opt.learning_rate)
        self.weight_decay = float(opt.get("weight_decay", 0.0))
        self.betas = tuple(float(b) for b in opt.get("betas", (0.9, 0.999)))
        self.eps = float(opt.get("eps", 1e-8))
        self.fused = bool(opt.get("fused", True))  # the trainer's AdamW kernel (OptimizerConfig.fused)
        self.max_new_tokens = int(recipe.pipeline.max_new_tokens)
        self.temperature = float(recipe.pipeline.get("temperature", 1.0))
        self.rewards: list[tuple[str, Callable[..., list[float]], float, dict[str, Any]]] = []
        for name, spec in recipe.reward.rewards.items():
            fn = spec.fn if isinstance(spec.fn, str) else spec.fn._target_
            kwargs = dict(spec.get("kwargs") or {})
            self.rewards.append((str(name), locate(fn, "reward"), float(spec.get("weight", 1.0)), kwargs))

    def score(self, completions: list[str], prompts: list[str]) -> np.ndarray:
        """The recipe's weighted reward sum, computed inline (what the reward Serve app computes)."""
        total = np.zeros(len(completions), dtype=np.float64)
        for name, fn, weight, kwargs in self.rewards:
            values = fn(completions=completions, prompts=prompts, **kwargs)
            if any(v is None for v in values):
                raise SystemExit(f"reward {name} returned None; the bare loop and TRL side expect every sample scored")
            total += weight * np.asarray(values, dtype=np.float64)
        return total

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """GRPO: ``(r - mean_g) / (std_g + 1e-4)``, population std, 0 for groups whose rewards are all equal."""
        grouped = rewards.reshape(-1, self.group_size)
        centered = grouped - grouped.mean(axis=1, keepdims=True)
        if self.normalize_std:
            centered = centered / (grouped.std(axis=1, keepdims=True) + 1e-4)
        centered[np.ptp(grouped, axis=1) == 0] = 0.0
        return centered.reshape(-1)

    def describe(self) -> str:
        return (f"{self.num_samples} completions/step ({self.prompts_per_step} prompts x {self.group_size}), "
                f"max_new_tokens {self.max_new_tokens}, temperature {self.temperature:g}, lr {self.lr:g}, "
                f"clip {self.clip_low:g}/{self.clip_high:g}, no KL, 1 update/batch, micro-batch {self.micro}, "
                f"optimizer step per {self.mini} samples, grad clip {self.max_grad_norm}")


def check_same_task(direct, engine) -> None:
    """The two recipes must describe the same model, task and hyperparameters (only the rollout differs)."""
    from omegaconf import OmegaConf

    def view(recipe) -> dict[str, Any]:
        out = {}
        for section in ("bundle", "pipeline", "backend", "algorithm", "stack", "data", "reward"):
            out[section] = OmegaConf.to_container(recipe[section], resolve=True)
        out["trainer"] = {k: recipe.trainer[k] for k in ("seed", "prompts_per_step")}
        out["ray"] = recipe.ray.scaling.num_workers
        return out

    a, b = view(direct), view(engine)
    diff = sorted(k for k in a if a[k] != b[k])
    if diff:
        raise SystemExit(f"the direct and engine recipes differ in {diff}; the comparison needs the same task")


# ---------------------------------------------------------------------------------------------
# (A), (B) the trainer, driven block by block


def trainer_side(recipe, total_steps: int) -> DrivenTrainer:
    """A real ``ARTrainer``: ``setup()``, ``run_step(i)`` per step (logged to MLflow and checkpointed
    as ``run_steps`` does), ``teardown()``; each step's record as the other sides keep it."""
    from unirl_ray.trainer.ar import ARTrainer

    return DrivenTrainer(ARTrainer(recipe), on_step=_trainer_record, checkpoint_steps=total_steps)


def _trainer_record(step: int, m: dict, times: dict) -> dict[str, float]:
    return {
        "log": times["log_s"],
        "checkpoint": times["checkpoint_s"],
        "time": float(m["timing/step"]),
        "rollout": float(m["timing/rollout"]),
        "reward": float(m.get("timing/reward", float("nan"))),
        "train": float(m["timing/train"]),
        "train_worker": float(m.get("timing/train_step", float("nan"))),
        "sync": float(m.get("timing/weight_sync", float("nan"))),
        "reward_mean": float(m["reward/mean"]),
        "logp_gap": float(m.get("rollout/logp_gap", float("nan"))),
    }


# ---------------------------------------------------------------------------------------------
# (D) the bare loop


class BareLoop:
    """Same model, prompts, seeds, samples per step and GRPO math; one process, plain torch."""

    def __init__(self, recipe, task: Task, schedule: list[list[str]]) -> None:
        from unirl_ray.config.recipe import instantiate
        from unirl_ray.trainer.base import derive_seed

        self.task = task
        self.schedule = schedule
        self.derive_seed = derive_seed
        torch.manual_seed(task.seed)  # as the train workers do before building
        self.bundle = instantiate(recipe.bundle)
        self.pipeline = instantiate(recipe.pipeline, bundle=self.bundle)
        self.model = self.bundle.model
        self.model.requires_grad_(True)
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": task.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=task.lr, betas=task.betas, eps=task.eps,
                                           fused=task.fused)
        self.done = 0
        self.steps: dict[int, dict[str, float]] = {}

    def run_block(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.done += 1
            self.steps[self.done] = self.step(self.done)
        return time.perf_counter() - t0

    def step(self, step: int) -> dict[str, float]:
        task = self.task
        t_step = time.perf_counter()
        G, n = task.group_size, task.num_samples
        prompts = [self.schedule[step - 1][i // G] for i in range(n)]
        seeds = [self.derive_seed(task.seed, "sample", step, i) for i in range(n)]

        t0 = time.perf_counter()
        parts, texts = [], []
        for lo in range(0, n, task.rollout_micro):
            for part, text in self.pipeline.sample(prompts[lo:lo + task.rollout_micro], seeds[lo:lo + task.rollout_micro]):
                parts.append(part)
                texts.append(text)
        t_rollout = time.perf_counter() - t0

        t0 = time.perf_counter()
        rewards = task.score(texts, prompts)
        adv = torch.from_numpy(task.advantages(rewards)).float()
        t_reward = time.perf_counter() - t0

        t0 = time.perf_counter()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.derive_seed(task.seed, "train", step)))
        gap_sum, gap_count, first = 0.0, 0.0, True
        for lo in range(0, n, task.mini):
            mini = order[lo:lo + task.mini].tolist()
            n_micro = -(-len(mini) // task.micro)
            for mlo in range(0, len(mini), task.micro):
                idx = mini[mlo:mlo + task.micro]
                batch = self.pipeline.collate([parts[i] for i in idx])
                logp, _ = self.pipeline.token_log_probs(self.model, batch)
                mask, old = batch["completion_mask"], batch["old_log_probs"]
                log_ratio = (logp - old) * mask
                ratio = torch.exp(log_ratio)
                a = adv[idx][:, None]
                per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1 - task.clip_low, 1 + task.clip_high))
                per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
                (per_seq.mean() / n_micro).backward()
                if first:
                    gap_sum += float((log_ratio.detach().abs() * mask).sum())
                    gap_count += float(mask.sum())
            if task.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), float(task.max_grad_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            first = False
        t_train = time.perf_counter() - t0
        return {
            "time": time.perf_counter() - t_step,
            "rollout": t_rollout,
            "reward": t_reward,
            "train": t_train,
            "sync": float("nan"),
            "reward_mean": float(rewards.mean()),
            "logp_gap": gap_sum / max(gap_count, 1.0),
        }

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# (C) TRL's GRPOTrainer, run in a thread and paused between blocks


def _no_activation_checkpointing(config_class: type) -> dict[str, bool]:
    """The argument that turns activation checkpointing off, by the name this TRL / transformers uses
    (``gradient_checkpointing`` in TRL 1.16 with transformers 5.x, ``activation_checkpointing`` elsewhere)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    return {name: False for name in ("activation_checkpointing", "gradient_checkpointing") if name in names}


class TRLSide:
    """TRL ``GRPOTrainer`` on a fresh copy of the same tiny model; ``train()`` runs in a thread.

    A callback gates every ``on_step_begin``: the thread waits there until the driver releases the
    next block. Step ``k`` lasts from its release to the next ``on_step_begin``: one whole iteration
    of TRL's loop (generation, reward, advantages, forward/backward, optimizer step, logging, the
    next batch).
    """

    def __init__(self, recipe, task: Task, schedule: list[list[str]], total_steps: int, out_dir: str) -> None:
        import transformers
        from datasets import Dataset
        from transformers import TrainerCallback
        from transformers.trainer_callback import PrinterCallback, ProgressCallback
        from trl import GRPOConfig, GRPOTrainer

        from unirl_ray.config.recipe import instantiate

        transformers.logging.set_verbosity_error()
        warnings.filterwarnings("ignore", message=r".*is deprecated and will be removed in v6.*", category=FutureWarning)
        self.task = task
        self.schedule = schedule
        torch.manual_seed(task.seed)
        bundle = instantiate(recipe.bundle)  # same config and seed: the same initial weights as A, B, D
        self.reward_calls: list[dict[str, Any]] = []
        self.gen_calls: list[float] = []
        side = self

        def char_reward(completions, prompts=None, **_):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            plain = [p[-1]["content"] if isinstance(p, list) else p for p in (prompts or [""] * len(texts))]
            rewards = task.score(texts, plain)
            side.reward_calls.append({"prompts": plain[:: task.group_size], "mean": float(rewards.mean())})
            return rewards.tolist()

        char_reward.__name__ = "_".join(name for name, *_ in task.rewards)

        # the schedule's prompts in order: with shuffle_dataset=False, TRL's step k takes rows 4k..4k+3
        rows = [{"prompt": [{"role": "user", "content": p}]} for step in schedule for p in step]
        accumulation = task.mini // task.micro  # micro-batches per optimizer step, as A and D
        self.args = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            fp16=False,
            **_no_activation_checkpointing(GRPOConfig),  # TRL's default is on
            seed=task.seed,
            max_steps=total_steps + 1,  # one more than measured: the gate holds the thread at its start
            per_device_train_batch_size=task.micro,
            gradient_accumulation_steps=accumulation,
            steps_per_generation=accumulation,  # one generation of mini-batch size per optimizer step
            num_generations=task.group_size,
            num_iterations=1,
            max_completion_length=task.max_new_tokens,
            temperature=task.temperature,
            top_p=1.0,
            top_k=0,
            learning_rate=task.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=task.weight_decay,
            adam_beta1=task.betas[0],
            adam_beta2=task.betas[1],
            adam_epsilon=task.eps,
            optim="adamw_torch_fused" if task.fused else "adamw_torch",
            max_grad_norm=float(task.max_grad_norm) if task.max_grad_norm is not None else 0.0,
            beta=0.0,
            epsilon=task.clip_low,
            epsilon_high=task.clip_high,
            loss_type="grpo",
            scale_rewards="group" if task.normalize_std else "none",
            mask_truncated_completions=False,
            disable_dropout=True,
            shuffle_dataset=False,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            log_completions=False,
        )
        if task.num_samples != task.mini:
            raise SystemExit("the TRL side matches one optimizer step per rollout batch (mini-batch = all samples)")

        class Gate(StepGate, TrainerCallback):
            pass

        self.gate = Gate()
        self.trainer = GRPOTrainer(
            model=bundle.model,
            reward_funcs=char_reward,
            args=self.args,
            train_dataset=Dataset.from_list(rows),
            processing_class=bundle.tokenizer,
            callbacks=[self.gate],
        )
        for cb in (PrinterCallback, ProgressCallback):
            self.trainer.remove_callback(cb)
        generate_and_score = self.trainer._generate_and_score_completions

        def timed(*args, **kwargs):  # timing only: TRL's own method, unchanged
            t0 = time.perf_counter()
            out = generate_and_score(*args, **kwargs)
            side.gen_calls.append(time.perf_counter() - t0)
            return out

        self.trainer._generate_and_score_completions = timed
        self.loop = GatedLoop(self.trainer.train, self.gate, "trl-grpo")
        self.done = 0
        self.steps: dict[int, dict[str, float]] = {}

    def setup(self) -> float:
        return self.loop.start()

    def run_block(self, n: int) -> float:
        wall = self.loop.release(n)
        for k in range(self.done + 1, self.done + n + 1):
            gen = self.gen_calls[k - 1] if k - 1 < len(self.gen_calls) else float("nan")
            elapsed = self.loop.step_s(k)
            self.steps[k] = {
                "time": elapsed,
                "rollout": gen,  # TRL's _generate_and_score_completions: generation + reward + advantages
                "reward": float("nan"),
                "train": elapsed - gen,
                "sync": float("nan"),
                "reward_mean": self.reward_calls[k - 1]["mean"],
                "logp_gap": 0.0,  # TRL uses the recomputed log-probs as pi_old (num_iterations=1)
            }
        self.done += n
        return wall

    def prompts_of(self, step: int) -> list[str] | None:
        return self.reward_calls[step - 1]["prompts"] if step - 1 < len(self.reward_calls) else None

    def close(self) -> None:
        self.loop.close()


# ---------------------------------------------------------------------------------------------
# driver


def prompt_schedule(recipe, steps: int) -> list[list[str]]:
    """The prompts the trainer will draw for steps 1..steps (a fresh copy of its deterministic source)."""
    from unirl_ray.config.recipe import instantiate

    source = instantiate(recipe.data)
    return [[row["prompt"] for row in source.next_batch(int(recipe.trainer.prompts_per_step))] for _ in range(steps)]


def first_reaching(curve: dict[int, float], threshold: float) -> int | None:
    for step in sorted(curve):
        if curve[step] >= threshold:
            return step
    return None


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, str, list[str]]:
    """The arguments, the sides to run (C dropped when TRL is missing) and notes for the report."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direct-recipe", default=str(DEFAULT_DIRECT), help="AR recipe with direct rollout (side A; also the task of C and D)")
    ap.add_argument("--engine-recipe", default=str(DEFAULT_ENGINE), help="AR recipe with a dedicated engine (side B)")
    ap.add_argument("--sides", default="ABCD", help="which sides to run, e.g. AD (default ABCD)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up steps of each side, excluded from the medians")
    ap.add_argument("--blocks", type=int, default=6, help="measured blocks per side (A,B,C,D,A,B,C,D,...)")
    ap.add_argument("--block-steps", type=int, default=6, help="RL steps per block")
    ap.add_argument("--threshold", type=float, default=0.5, help="batch-mean reward whose first crossing is reported")
    ap.add_argument("--bare-threads", type=int, default=None,
                    help="torch intra-op threads of this process (C and D; default: torch's default for this machine)")
    ap.add_argument("--json-out", default=None, help="also write the JSON result line to this file")
    ap.add_argument("--keep-storage", action="store_true", help="keep the temporary storage path (MLflow DB, checkpoints)")
    ap.add_argument("--direct-override", action="append", default=[], metavar="KEY=VALUE",
                    help="an override of the direct recipe only (sides A, C, D), e.g. rollout.micro_batch_size=32")
    ap.add_argument("overrides", nargs="*", help="extra recipe overrides key=value (applied to both recipes)")
    args = ap.parse_args(argv)
    sides = "".join(s for s in "ABCD" if s in args.sides.upper())
    if not sides or set(args.sides.upper()) - set("ABCD"):
        ap.error("--sides takes letters from ABCD")
    if args.warmup < 1 or args.blocks < 1 or args.block_steps < 1:
        ap.error("--warmup, --blocks and --block-steps must be >= 1")
    notes: list[str] = []
    if "C" in sides:
        ok, why = trl_available()
        if not ok:
            print(f"[bench] skipping C: {why}", flush=True)
            notes.append(f"C skipped: {why}")
            sides = sides.replace("C", "")
        else:
            notes.append(why)
    return args, sides, notes


def load_recipes(args, storage: str, total: int) -> tuple[Any, Any]:
    """The direct and engine recipes of this run."""
    from unirl_ray.config.recipe import load_recipe

    def recipe_for(path: str, name: str, extra: list[str]):
        return load_recipe(path, [
            f"trainer.run_name=bench-{name}",
            f"trainer.storage_path={storage}",
            f"trainer.num_steps={total}",
            "tracking.experiment_name=bench-ar-vs-trl",
            *args.overrides,
            *extra,
        ])

    return recipe_for(args.direct_recipe, "ar-direct", args.direct_override), recipe_for(args.engine_recipe, "ar-engine", [])


def start_sides(sides: str, direct, engine, task: Task, total: int, storage: str,
                runners: dict[str, Any], setup_s: dict[str, float]) -> list[list[str]]:
    """Set up every side (into ``runners`` and ``setup_s``, so that what started is torn down on a
    failure); returns the prompt schedule of steps 1..total+2."""
    for side, recipe in (("A", direct), ("B", engine)):
        if side in sides:
            print(f"[bench] setting up {side} ({SIDE_NAMES[side]}) ...", flush=True)
            runners[side] = trainer_side(recipe, total)
            setup_s[side] = runners[side].setup()
            print(f"[bench] {side} ready in {setup_s[side]:.1f}s", flush=True)
    if not ("A" in sides or "B" in sides):  # the prompt source reads with Ray Data: start Ray as the trainer would
        from unirl_ray.config.recipe import instantiate
        from unirl_ray.runtime.cluster import ensure_ray

        ensure_ray(instantiate(direct.ray))
    schedule = prompt_schedule(direct, total + 2)
    if "C" in sides:
        print(f"[bench] setting up C ({SIDE_NAMES['C']}) ...", flush=True)
        t0 = time.perf_counter()
        runners["C"] = TRLSide(direct, task, schedule, total, os.path.join(storage, "trl"))
        setup_s["C"] = time.perf_counter() - t0 + runners["C"].setup()
        print(f"[bench] C ready in {setup_s['C']:.1f}s", flush=True)
    if "D" in sides:
        t0 = time.perf_counter()
        runners["D"] = BareLoop(direct, task, schedule)
        setup_s["D"] = time.perf_counter() - t0
    return schedule


def run_blocks(args, sides: str, runners: dict[str, Any]) -> Interleave:
    """Warm-up, then ``--blocks`` rounds of A, B, C, D (the sides that run), ``--block-steps`` steps each."""
    blocks = Interleave(sides)
    print(f"[bench] warm-up: {args.warmup} steps of each of {', '.join(sides)}", flush=True)
    for side in sides:
        blocks.run(side, args.warmup, runners[side].run_block, measured=False)
    for block in range(args.blocks):
        print(f"[bench] block {block + 1}/{args.blocks}: {', '.join(sides)}, {args.block_steps} steps each", flush=True)
        for side in sides:
            blocks.run(side, args.block_steps, runners[side].run_block, measured=True)
    for side in ("A", "B"):
        if side in runners:
            runners[side].finish()
    return blocks


def side_stats(args, sides: str, runners: dict[str, Any], blocks: Interleave, setup_s: dict[str, float],
               measured: list[int]) -> dict[str, dict[str, Any]]:
    """Per side: step and stage medians, wall and CPU per step, block medians, the reward curve."""
    stats: dict[str, dict[str, Any]] = {}
    for side in sides:
        steps = runners[side].steps
        series = {k: [steps[s][k] for s in measured] for k in ("time", *STAGES)}
        curve = {s: steps[s]["reward_mean"] for s in sorted(steps)}
        cpu_main, cpu_ray = blocks.cpu_median(side)
        stats[side] = {
            "step_median_s": median(series["time"]),
            "step_min_s": min(series["time"]),
            "stages_median_s": {k: median(series[k]) for k in STAGES},
            "wall_per_step_median_s": median(blocks.walls[side]),
            "cpu_s_per_step_median": {"main_process": cpu_main, "ray_processes": cpu_ray},
            "ray_cpu_s_per_step_by_kind": blocks.cpu_kinds_median(side),
            "block_medians_s": [median([steps[s]["time"] for s in measured[b * args.block_steps:(b + 1) * args.block_steps]])
                                for b in range(args.blocks)],
            "steps_to_threshold": first_reaching(curve, args.threshold),
            "reward_step1": curve.get(1),
            "reward_last5_mean": float(np.mean([curve[s] for s in sorted(curve)[-5:]])),
            "reward_curve": [curve[s] for s in sorted(curve)],
            "max_logp_gap": max(steps[s]["logp_gap"] for s in steps),
            "setup_s": setup_s.get(side),
            "step_s": series["time"],
        }
        if side in "AB":
            ckpts = [steps[s]["checkpoint"] for s in measured if np.isfinite(steps[s]["checkpoint"])]
            stats[side]["mlflow_log_median_s"] = median([steps[s]["log"] for s in measured])
            stats[side]["train_worker_compute_median_s"] = median([steps[s]["train_worker"] for s in measured])
            stats[side]["checkpoint_s"] = ckpts
    return stats


def print_table_of_sides(sides: str, stats: dict[str, dict[str, Any]], total: int, threshold: float) -> None:
    d = stats.get("D", {}).get("step_median_s")
    rows = []
    for side in sides:
        st = stats[side]
        sm = st["stages_median_s"]
        ratio = st["step_median_s"] / d if d else float("nan")
        over = (st["step_median_s"] - d) * 1e3 if d else float("nan")
        reach = st["steps_to_threshold"]
        cpu_total = sum(st["cpu_s_per_step_median"].values())
        rows.append([f"{side} {SIDE_NAMES[side]}", _fmt(st["step_median_s"]), _fmt(st["step_min_s"]),
                     _fmt(st["wall_per_step_median_s"]), _fmt(sm["rollout"]), _fmt(sm["reward"]), _fmt(sm["train"]),
                     _fmt(sm["sync"]), _fmt(cpu_total), _fmt(ratio, 6, 2), _fmt(over, 7, 0),
                     str(reach) if reach else f">{total}", _fmt(st["reward_step1"], 6, 3),
                     _fmt(st["reward_last5_mean"], 7, 3)])
    print_table(["side", "step", "min", "wall", "rollout", "reward", "train", "sync", "CPU-s", "x D", "-D ms", "reach",
                 "r@1", "r last5"], rows, [44, 7, 7, 7, 7, 7, 7, 7, 7, 6, 7, 6, 6, 7])
    print("  step = the side's own per-step timer (A/B: timing/step; C: one whole TRL loop iteration; D: the whole step),"
          " seconds, median; wall = block wall time / steps (A/B: + MLflow logging and checkpoints); C's rollout ="
          " generation + reward + advantages; CPU-s = CPU seconds per step of this process and the Ray processes;"
          f" reach = first step with batch-mean reward >= {threshold:g} (budget {total} steps)")


def print_vs_bare(sides: str, stats: dict[str, dict[str, Any]], runners: dict[str, Any]) -> None:
    """Each side's overhead over D: in total, per block, on the fastest steps, and stage by stage."""
    d = stats["D"]["step_median_s"]
    for side in sides:
        if side == "D":
            continue
        st = stats[side]
        pairs = [a / b for a, b in zip(st["block_medians_s"], stats["D"]["block_medians_s"])]
        print(f"  {side} - D = {(st['step_median_s'] - d) * 1e3:.0f} ms/step (wall: "
              f"{(st['wall_per_step_median_s'] - stats['D']['wall_per_step_median_s']) * 1e3:.0f} ms), "
              f"{side}/D = {st['step_median_s'] / d:.2f}x; per block {' '.join(f'{r:.2f}' for r in pairs)}; "
              f"fastest steps {side}/D {st['step_min_s'] / stats['D']['step_min_s']:.2f}x")
    for side in sides:
        if side in "AB":
            st, sd = stats[side]["stages_median_s"], stats["D"]["stages_median_s"]
            other = stats[side]["step_median_s"] - sum(v for v in st.values() if np.isfinite(v))
            other_d = d - sum(v for v in sd.values() if np.isfinite(v))
            print(f"  {side} - D by stage (medians, ms): rollout {(st['rollout'] - sd['rollout']) * 1e3:+.0f}, "
                  f"reward {(st['reward'] - sd['reward']) * 1e3:+.0f}, train {(st['train'] - sd['train']) * 1e3:+.0f} "
                  f"(worker compute, timing/train_step on rank 0: {stats[side]['train_worker_compute_median_s'] * 1e3:.0f} "
                  f"vs D's train {sd['train'] * 1e3:.0f})"
                  + (f", weight sync {st['sync'] * 1e3:+.0f}" if np.isfinite(st["sync"]) else "")
                  + f", rest {(other - other_d) * 1e3:+.0f}; outside timing/step: MLflow log_metrics "
                  f"{stats[side]['mlflow_log_median_s'] * 1e3:.0f} ms/step, checkpoints "
                  + (", ".join(f"{c:.2f}" for c in stats[side]["checkpoint_s"]) + " s" if stats[side]["checkpoint_s"] else "none")
                  + f" (every {runners[side].trainer.run_cfg.checkpoint_every} steps)")
    for side in (s for s in sides if s in "AB"):
        kinds = {k: v for k, v in stats[side]["ray_cpu_s_per_step_by_kind"].items() if v >= 0.0005}
        main = stats[side]["cpu_s_per_step_median"]["main_process"]
        shown = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        print(f"  {side}'s CPU per step by process (block medians, ms): this process (driver) {main * 1e3:.1f}, {shown}")
    ray_idle = stats["D"]["cpu_s_per_step_median"]["ray_processes"] if "D" in stats else float("nan")
    if np.isfinite(ray_idle):
        print(f"  while D ran, the idle Ray processes used {ray_idle:.3f} CPU-s per D step")


def print_checks(sides: str, stats: dict[str, dict[str, Any]], prompt_mismatch: dict[str, list[int]]) -> None:
    """Same math on every side: step-1 rewards and reward curves, on-policy log-probs, the same prompts."""
    same = [s for s in "ABD" if s in sides]
    if len(same) > 1:
        r1 = {s: stats[s]["reward_step1"] for s in same}
        curves = {s: stats[s]["reward_curve"] for s in same}
        ref = curves[same[-1]]
        agree = {}
        for s in same[:-1]:
            diverge = next((i + 1 for i, (x, y) in enumerate(zip(curves[s], ref)) if abs(x - y) > 1e-6), None)
            agree[s] = diverge
        print(f"  checks: step-1 reward {', '.join(f'{s} {v:.6f}' for s, v in r1.items())} (same weights, prompts, seeds); "
              + "; ".join(f"{s} vs {same[-1]}: reward curves " + (f"first differ at step {v}" if v else "identical")
                          for s, v in agree.items()))
    print("  max first-pass |logp - logp_old| per token: "
          + ", ".join(f"{s} {stats[s]['max_logp_gap']:.1e}" for s in sides)
          + "; prompts per step: " + ("identical on every side" if not prompt_mismatch else f"MISMATCH {prompt_mismatch}"))
    print("  reward curves (every 5th step): " + "; ".join(
        f"{s} " + " ".join(f"{v:.2f}" for v in stats[s]["reward_curve"][::5]) for s in sides))


def main(argv: list[str] | None = None) -> int:
    args, sides, notes = parse_args(argv)
    logging.basicConfig(level=os.environ.get("UNIRL_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    t_all = time.perf_counter()
    storage = tempfile.mkdtemp(prefix="unirl_bench_ar_vs_trl_")
    total = args.warmup + args.blocks * args.block_steps
    direct, engine = load_recipes(args, storage, total)
    if "B" in sides:
        check_same_task(direct, engine)
    task = Task(direct)
    if args.bare_threads:
        torch.set_num_threads(args.bare_threads)

    runners: dict[str, Any] = {}
    setup_s: dict[str, float] = {}
    load_start = os.getloadavg()[0]
    try:
        schedule = start_sides(sides, direct, engine, task, total, storage, runners, setup_s)
        blocks = run_blocks(args, sides, runners)
    finally:
        close_all({side: runners[side] for side in "CBA" if side in runners})
        shutdown_ray()
        if not args.keep_storage:
            shutil.rmtree(storage, ignore_errors=True)
    load_end = os.getloadavg()[0]

    measured = list(range(args.warmup + 1, total + 1))
    stats = side_stats(args, sides, runners, blocks, setup_s, measured)
    # prompts: every side must have trained on the same prompts, step by step
    prompt_mismatch = {}
    for side in sides.replace("D", ""):
        bad = [s for s in range(1, total + 1) if runners[side].prompts_of(s) != schedule[s - 1]]
        if bad:
            prompt_mismatch[side] = bad[:5]

    print()
    print("GRPO on the tiny demo causal LM (char tokenizer), reward: "
          + " + ".join(f"{w:g} x {n}{kw}" for n, _, w, kw in task.rewards))
    print(f"  {task.describe()}; A/B: {task.workers} Ray Train workers; C/D: torch threads {torch.get_num_threads()}")
    print(f"  warm-up {args.warmup} steps each, then {args.blocks} blocks x {args.block_steps} steps, order "
          f"{' '.join(blocks.order)}; medians over {len(measured)} measured steps per side")
    print_table_of_sides(sides, stats, total, args.threshold)
    if stats.get("D", {}).get("step_median_s"):
        print_vs_bare(sides, stats, runners)
    print_checks(sides, stats, prompt_mismatch)
    print(f"  setup seconds: {', '.join(f'{s} {v:.1f}' for s, v in setup_s.items())}; "
          f"1-min load average {load_start:.1f} at start, {load_end:.1f} at end ({os.cpu_count()} CPUs)"
          + "".join(f"; {note}" for note in notes))

    d = stats.get("D", {}).get("step_median_s")
    result = {
        "bench": "ar_grpo_vs_trl",
        "recipes": {"A": os.path.relpath(args.direct_recipe, REPO), "B": os.path.relpath(args.engine_recipe, REPO)},
        "overrides": args.overrides,
        "direct_overrides": args.direct_override,
        "sides": {s: SIDE_NAMES[s] for s in sides},
        "task": task.describe(),
        "workers": task.workers,
        "warmup_steps": args.warmup,
        "blocks": args.blocks,
        "block_steps": args.block_steps,
        "step_budget": total,
        "threshold": args.threshold,
        "measured_steps_per_side": len(measured),
        "overhead_vs_d_ms": {s: (stats[s]["step_median_s"] - d) * 1e3 for s in sides if d and s != "D"},
        "ratio_vs_d": {s: stats[s]["step_median_s"] / d for s in sides if d and s != "D"},
        "stats": stats,
        "prompt_mismatch": prompt_mismatch,
        "notes": notes,
        "total_wall_s": time.perf_counter() - t_all,
        "loadavg_1min": {"start": load_start, "end": load_end},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "torch_threads": torch.get_num_threads()},
    }
    emit_json(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
