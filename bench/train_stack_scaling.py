"""Train step of the real stack (FSDPBackend + TrainStack + GRPO) on 1 vs 2 ranks, vs a bare PyTorch loop.

A benchmark, not a test: it asserts nothing about speed. It builds one GRPO batch with the tiny demo
causal LM of ``recipes/ar/tiny/char_grpo_direct.yaml`` (completions sampled once, rewards and group
advantages computed once) and then times only the train step on that same batch, in alternating
blocks, in four configurations that do the same math from the same initial weights:

  bare      one process, plain torch: ``pipeline.collate`` / ``token_log_probs``, the token-level
            clipped GRPO loss over micro-batches, gradient clipping, ``torch.optim.AdamW``;
  plain-1w  the real ``StackWorker`` (bundle, pipeline, ``FSDPBackend``, ``GRPO``, ``TrainStack``
            built from the recipe) in one spawned process WITHOUT a process group: the backend
            leaves the module unwrapped, so this is the cost of the stack and the algorithm alone;
  stack-1w  the same with a gloo process group of 1 rank: FSDP2 ``fully_shard`` (DTensor
            parameters), as a 1-worker Ray Train run has;
  stack-2w  the same on 2 ranks (FSDP2 over gloo), each training on half of the batch.

No Ray: the stack workers are driven directly over ``torch.multiprocessing`` queues. Every
configuration takes one optimizer step per train step over the whole batch by default (``--mini``),
so the gradient is the same everywhere. Reported: median seconds per train step, samples/s,
``stack-1w / bare`` (the per-step cost of the stack at one rank), ``plain-1w / bare`` (of
TrainStack + GRPO without FSDP2), ``stack-2w / stack-1w`` (data-parallel scaling; 0.5 is ideal).

    python bench/train_stack_scaling.py                      # ~1-2 min on 2 busy cores
    python bench/train_stack_scaling.py --steps 24 --configs bare,stack-1w,stack-2w --json-out /tmp/scaling.json
    python bench/train_stack_scaling.py --width 256 --layers 4   # a bigger (still random) demo model

See bench/README.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import queue
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import cpu_seconds, free_port, median, offline_env  # noqa: E402  (bench/ is on sys.path when run as a script)

offline_env()

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


REPO = Path(__file__).resolve().parent.parent
DEFAULT_RECIPE = REPO / "recipes" / "ar" / "tiny" / "char_grpo_direct.yaml"
CONFIGS = {  # name -> (ranks, process group)
    "bare": (0, False),
    "plain-1w": (1, False),
    "stack-1w": (1, True),
    "stack-2w": (2, True),
}
WORKER_SECTIONS = ("bundle", "pipeline", "backend", "algorithm", "stack")
RESULT_TIMEOUT_S = 900.0


def _train_seed(seed: int, step: int) -> int:
    from unirl_ray.trainer.base import derive_seed

    return derive_seed(seed, "train", step)


# ---------------------------------------------------------------------------------------------
# the batch: sampled once, scored once, shared by every configuration


def read_prompt_rows(path: str, column: str) -> list[dict[str, Any]]:
    """Rows of a .txt / .jsonl / .json prompt file in file order (read directly: no Ray Data here)."""
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".txt"):
        return [{column: line.strip()} for line in text.splitlines() if line.strip()]
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if path.endswith(".json"):
        return list(json.loads(text))
    raise SystemExit(f"the bench reads .txt, .jsonl or .json prompt files, got {path}")


def build_batch(recipe) -> tuple[list, str]:
    """``prompts_per_step x group_size`` full GRPO samples (log-probs, rewards, advantages) of step 1,
    and a description of the model. The prompts are the first ``prompts_per_step`` rows of the file."""
    from unirl_ray.config.recipe import instantiate, locate
    from unirl_ray.rewards.combine import combine
    from unirl_ray.rollout.trainside import samples_from_outputs
    from unirl_ray.trainer.base import derive_seed

    seed, P = int(recipe.trainer.seed), int(recipe.trainer.prompts_per_step)
    G = int(recipe.algorithm.group_size)
    torch.manual_seed(seed)
    bundle = instantiate(recipe.bundle)
    pipeline = instantiate(recipe.pipeline, bundle=bundle)
    column = str(recipe.data.get("prompt_column", "prompt"))
    rows = read_prompt_rows(str(recipe.data.path), column)[:P]
    if len(rows) < P:
        raise SystemExit(f"{recipe.data.path} has {len(rows)} prompts; trainer.prompts_per_step={P} needs more")
    requests = [
        {"sample_id": f"s1-{p * G + g}", "group_id": f"s1-p{p}", "prompt": str(row[column]),
         "columns": {k: v for k, v in row.items() if k != column},
         "seed": derive_seed(seed, "sample", 1, p * G + g)}
        for p, row in enumerate(rows) for g in range(G)
    ]
    outputs = pipeline.sample([r["prompt"] for r in requests], [r["seed"] for r in requests])
    samples = samples_from_outputs(requests, outputs, policy_version=0)
    texts = [text for _, text in outputs]
    per_source, weights = {}, {}
    for name, spec in recipe.reward.rewards.items():
        fn = locate(str(spec.fn), "reward")
        columns = {k: [s.columns.get(k) for s in samples] for k in samples[0].columns}
        per_source[str(name)] = fn(completions=texts, prompts=[s.prompt for s in samples],
                                   **{**columns, **dict(spec.get("kwargs") or {})})
        weights[str(name)] = float(spec.get("weight", 1.0))
    for sample, total in zip(samples, combine(per_source, weights)):
        sample.reward = total
    instantiate(recipe.algorithm).compute_advantages(samples)
    n_params = sum(p.numel() for p in bundle.model.parameters())
    source = bundle.config.tiny if bundle.is_demo else bundle.config.pretrained_model_path
    return samples, f"{type(bundle.model).__name__}, {n_params / 1e6:.2f}M parameters, {source}"


# ---------------------------------------------------------------------------------------------
# the stack configurations: StackWorker processes driven over queues


def _stack_worker(rank: int, world: int, port: int | None, sections: dict, shard: list, seed: int,
                  threads: int, commands: Any, results: Any) -> None:
    """One rank: build the real StackWorker, then run ``("train", first_step, n)`` blocks until ``stop``."""
    try:
        torch.set_num_threads(threads)
        import torch.distributed as dist

        from unirl_ray.train.rank import StackWorker
        from unirl_ray.train.configs import TrainTopology

        if port is not None:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=600))
        topology = TrainTopology(world_size=world, rank=rank, dp_size=world, dp_rank=rank)
        logging.getLogger("unirl_ray.models.causal_lm").setLevel(logging.ERROR)  # the driver said it once
        torch.manual_seed(seed)  # as runtime.worker does before building
        worker = StackWorker(sections, topology=topology, device=torch.device("cpu"))
        results.put(("ready", rank, None))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            _, first, n = cmd
            steps = []
            for step in range(first, first + n):
                if port is not None:
                    dist.barrier()  # every rank starts the step together
                t0 = time.perf_counter()
                out = worker.train(shard, seed=_train_seed(seed, step))
                steps.append({"step": step, "time": time.perf_counter() - t0, **out["metrics"]})
            results.put(("done", rank, steps))
        if port is not None:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the driver, which stops the bench
        results.put(("error", rank, traceback.format_exc()))


class StackGroup:
    """``ranks`` spawned StackWorker processes (with or without a gloo process group) on one batch."""

    def __init__(self, name: str, *, ranks: int, distributed: bool, sections: dict, samples: list,
                 seed: int, threads: int) -> None:
        ctx = mp.get_context("spawn")
        self.name, self.ranks = name, ranks
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(ranks)]
        port = free_port() if distributed else None
        size = len(samples) // ranks  # contiguous shards, as the trainer splits requests
        self.procs = [
            ctx.Process(target=_stack_worker, name=f"{name}-rank{r}", daemon=True,
                        args=(r, ranks, port, sections, samples[r * size:(r + 1) * size], seed, threads,
                              self.commands[r], self.results))
            for r in range(ranks)
        ]
        for p in self.procs:
            p.start()

    def _collect(self, kind: str) -> dict[int, Any]:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(got) < self.ranks:
            try:
                status, rank, payload = self.results.get(timeout=5.0)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}: no answer ({'exited: ' + ', '.join(dead) if dead else 'timeout'})")
                continue
            if status == "error":
                raise RuntimeError(f"{self.name} rank {rank} failed:\n{payload}")
            assert status == kind, (status, kind)
            got[rank] = payload
        return got

    def wait_ready(self) -> None:
        self._collect("ready")

    def run_block(self, first: int, n: int) -> list[dict[str, float]]:
        """Steps ``first .. first+n-1``; rank 0's per-step records (metrics are reduced over ranks)."""
        for q in self.commands:
            q.put(("train", first, n))
        return self._collect("done")[0]

    def close(self) -> None:
        for q in self.commands:
            q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


# ---------------------------------------------------------------------------------------------
# the bare loop


class BareLoop:
    """The same GRPO train step in this process: plain module, plain AdamW, no stack, no FSDP."""

    def __init__(self, recipe, samples: list, *, mini: int) -> None:
        from unirl_ray.config.recipe import instantiate

        algo, stack, backend = recipe.algorithm, recipe.stack, recipe.backend
        self.seed = int(recipe.trainer.seed)
        self.clip_low, self.clip_high = float(algo.get("clip_low", 0.2)), float(algo.get("clip_high", 0.2))
        self.micro, self.mini = int(stack.micro_batch_size), mini
        self.max_grad_norm = stack.get("max_grad_norm")
        torch.manual_seed(self.seed)  # as the stack workers do before building
        bundle = instantiate(recipe.bundle)
        self.pipeline = instantiate(recipe.pipeline, bundle=bundle)
        self.model = bundle.model
        self.model.requires_grad_(True)
        opt = backend.optimizer_cfg
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": float(opt.get("weight_decay", 0.0))},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=float(opt.learning_rate),
                                           betas=tuple(float(b) for b in opt.get("betas", (0.9, 0.999))),
                                           eps=float(opt.get("eps", 1e-8)), fused=bool(opt.get("fused", True)))
        self.parts = [s.parts[0] for s in samples]
        self.adv = torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32)

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        n = len(self.parts)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(_train_seed(self.seed, step))).tolist()
        loss_sum, norms = 0.0, []
        for lo in range(0, n, self.mini):
            mini = order[lo:lo + self.mini]
            n_micro = -(-len(mini) // self.micro)
            for mlo in range(0, len(mini), self.micro):
                idx = mini[mlo:mlo + self.micro]
                batch = self.pipeline.collate([self.parts[i] for i in idx])
                logp, _ = self.pipeline.token_log_probs(self.model, batch)
                mask, old = batch["completion_mask"], batch["old_log_probs"]
                ratio = torch.exp((logp - old) * mask)
                a = self.adv[idx][:, None]
                per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1 - self.clip_low, 1 + self.clip_high))
                per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
                (per_seq.mean() / n_micro).backward()
                loss_sum += float(per_seq.detach().sum())
            limit = float(self.max_grad_norm) if self.max_grad_norm is not None else float("inf")
            norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"step": step, "time": time.perf_counter() - t0, "train/loss": loss_sum / n,
                "train/grad_norm": sum(norms) / len(norms)}


# ---------------------------------------------------------------------------------------------
# driver


def check_recipe(recipe) -> None:
    """The bare loop implements plain GRPO only; refuse anything else."""
    algo = recipe.algorithm
    want = {
        "algorithm._target_": (str(algo._target_).rsplit(".", 1)[-1], "GRPO"),
        "algorithm.advantage_estimator": (algo.get("advantage_estimator", "grpo"), "grpo"),
        "algorithm.loss_aggregation": (algo.get("loss_aggregation", "seq_mean_token_mean"), "seq_mean_token_mean"),
        "algorithm.kl_beta": (float(algo.get("kl_beta", 0.0)), 0.0),
        "algorithm.entropy_coef": (float(algo.get("entropy_coef", 0.0)), 0.0),
        "stack.num_updates_per_batch": (int(recipe.stack.get("num_updates_per_batch", 1)), 1),
        "backend.lora_cfg": (recipe.backend.get("lora_cfg"), None),
        "backend.lr_scheduler_cfg": (recipe.backend.get("lr_scheduler_cfg"), None),
    }
    bad = {k: v for k, (v, ok) in want.items() if v != ok}
    if bad:
        raise SystemExit(f"the bare loop implements plain GRPO (no KL, no entropy term, one update per batch, full "
                         f"fine-tuning, constant lr); the recipe sets {bad}")


def worker_sections(recipe, *, ranks: int, mini: int) -> dict:
    """The recipe's train sections as a StackWorker gets them, with the (global) mini-batch set."""
    from omegaconf import OmegaConf

    sections = {name: OmegaConf.to_container(recipe[name], resolve=True) for name in WORKER_SECTIONS}
    sections["stack"]["mini_batch_size"] = mini  # samples per optimizer step over all ranks
    return sections


def _fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "n/a"


class Schedule:
    """Runs the configurations in interleaved blocks and keeps every step's record."""

    def __init__(self, configs: list[str], groups: dict[str, StackGroup], bare: BareLoop | None) -> None:
        self.configs, self.groups, self.bare = configs, groups, bare
        self.records: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        self.blocks: dict[str, list[float]] = {c: [] for c in configs}  # median step time of each measured block
        self.cpu: dict[str, list[float]] = {c: [] for c in configs}  # CPU-s per step of each measured block
        self.order: list[str] = []
        self.next_step = {c: 1 for c in configs}

    def run(self, config: str, k: int, *, measured: bool) -> None:
        if k <= 0:
            return
        first = self.next_step[config]
        c0 = cpu_seconds()
        if config == "bare":
            out = [self.bare.step(s) for s in range(first, first + k)]
        else:
            out = self.groups[config].run_block(first, k)
        c1 = cpu_seconds()  # this process and its children: the stack workers
        self.next_step[config] += k
        self.order.append(f"{config}:{k}")
        for rec in out:
            rec["measured"] = measured
        self.records[config].extend(out)
        if measured:
            self.blocks[config].append(median([r["time"] for r in out]))
            self.cpu[config].append(((c1[0] - c0[0]) + (c1[1] - c0[1])) / k)

    def summary(self, n: int) -> dict[str, dict[str, Any]]:
        out = {}
        for c in self.configs:
            measured = [r for r in self.records[c] if r["measured"]]
            times = [r["time"] for r in measured]
            first, last = self.records[c][0], self.records[c][-1]
            out[c] = {
                "ranks": max(1, CONFIGS[c][0]),
                "fsdp2": CONFIGS[c][1],
                "step_median_s": median(times),
                "step_min_s": min(times),
                "samples_per_s": n / median(times),
                "block_medians_s": self.blocks[c],
                "cpu_s_per_step_median": median(self.cpu[c]),
                "train_step_median_s": median([r.get("timing/train_step", float("nan")) for r in measured]),
                "step1": {"loss": first["train/loss"], "grad_norm": first["train/grad_norm"]},
                "last": {"step": last["step"], "loss": last["train/loss"], "grad_norm": last["train/grad_norm"]},
                "step_s": times,
            }
        return out


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Median, per-block-pair, fastest-step and CPU-s ratios of the pairs that ran."""
    out = {}
    for a, b in (("stack-1w", "bare"), ("plain-1w", "bare"), ("stack-1w", "plain-1w"), ("stack-2w", "stack-1w"),
                 ("stack-2w", "bare")):
        if a in summary and b in summary:
            sa, sb = summary[a], summary[b]
            out[f"{a}/{b}"] = {
                "median": sa["step_median_s"] / sb["step_median_s"],
                "block_pairs": [x / y for x, y in zip(sa["block_medians_s"], sb["block_medians_s"])],
                "fastest": sa["step_min_s"] / sb["step_min_s"],
                "cpu": sa["cpu_s_per_step_median"] / sb["cpu_s_per_step_median"],
            }
    return out


def same_math(summary: dict[str, dict[str, Any]], configs: list[str]) -> dict[str, dict[str, float]]:
    """Step-1 grad norm and last-step loss of every configuration against the first one."""
    ref = summary[configs[0]]
    return {c: {"step1_grad_norm_rel": abs(summary[c]["step1"]["grad_norm"] / ref["step1"]["grad_norm"] - 1),
                "last_loss_abs": abs(summary[c]["last"]["loss"] - ref["last"]["loss"])}
            for c in configs[1:] if summary[c]["last"]["step"] == ref["last"]["step"]}


def print_report(summary, rat, gaps, configs: list[str], header: str) -> None:
    print()
    print(header)
    print(f"{'config':<10} {'ranks':>5} {'step (median)':>14} {'fastest':>8} {'samples/s':>10} {'CPU-s/step':>11} "
          f"{'loss step 1':>12} {'grad_norm 1':>12} {'loss last':>10}")
    for c in configs:
        s = summary[c]
        print(f"{c:<10} {s['ranks']:>5} {_fmt(s['step_median_s']):>13}s {_fmt(s['step_min_s']):>7}s "
              f"{s['samples_per_s']:>10.1f} {_fmt(s['cpu_s_per_step_median']):>11} {s['step1']['loss']:>12.6f} "
              f"{s['step1']['grad_norm']:>12.6f} {s['last']['loss']:>10.6f}")
    for name, r in rat.items():
        print(f"{name:<18} {r['median']:.2f}x   (per block pair: {' '.join(f'{x:.2f}' for x in r['block_pairs'])}; "
              f"fastest steps: {r['fastest']:.2f}x; CPU-s per step: {r['cpu']:.2f}x)")
    if gaps:
        ref = configs[0]
        print(f"checks (same math, vs {ref}): step-1 grad norm rel. diff "
              + ", ".join(f"{c} {g['step1_grad_norm_rel']:.1e}" for c, g in gaps.items())
              + f"; step-{summary[ref]['last']['step']} loss abs. diff "
              + ", ".join(f"{c} {g['last_loss_abs']:.1e}" for c, g in gaps.items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(DEFAULT_RECIPE), help="AR GRPO recipe (default: the tiny char task)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--steps", type=int, default=60, help="measured train steps per configuration")
    ap.add_argument("--blocks", type=int, default=6, help="measured blocks per configuration (interleaved)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration, excluded")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process (bare loop and each rank)")
    ap.add_argument("--mini", type=int, default=None,
                    help="samples per optimizer step over all ranks (default: the whole batch, one step per train step)")
    ap.add_argument("--width", type=int, default=None, help="hidden size of the demo model (default: TinyLMConfig's)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the demo model (default: TinyLMConfig's)")
    ap.add_argument("--json-out", default=None, help="also write the JSON result line to this file")
    ap.add_argument("overrides", nargs="*", help="recipe overrides key=value (e.g. trainer.prompts_per_step=8)")
    args = ap.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        ap.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    if args.steps < 1 or args.blocks < 1 or args.warmup < 0 or args.threads < 1:
        ap.error("--steps and --blocks must be >= 1, --warmup >= 0, --threads >= 1")
    if args.width or args.layers:  # a bigger demo model: TinyLMConfig knobs
        args.overrides.append("+bundle.config.tiny._target_=unirl_ray.models.causal_lm.TinyLMConfig")
        if args.width:
            args.overrides += [f"+bundle.config.tiny.hidden_size={args.width}",
                               f"+bundle.config.tiny.intermediate_size={2 * args.width}",
                               f"+bundle.config.tiny.num_attention_heads={max(1, args.width // 32)}"]
        if args.layers:
            args.overrides.append(f"+bundle.config.tiny.num_layers={args.layers}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = args.configs
    block_steps = -(-args.steps // args.blocks)
    from unirl_ray.config.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    check_recipe(recipe)
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    load_start = os.getloadavg()[0]

    samples, model_desc = build_batch(recipe)
    logging.getLogger("unirl_ray.models.causal_lm").setLevel(logging.ERROR)  # the demo-model warning came once
    n, micro = len(samples), int(recipe.stack.micro_batch_size)
    mini = args.mini or n
    for ranks in {max(1, CONFIGS[c][0]) for c in configs}:
        if n % ranks or mini % ranks or n % mini or (mini // ranks) % micro:
            raise SystemExit(f"{n} samples must split into {ranks} equal shards, global mini-batches of {mini} and "
                             f"micro-batches of {micro} per rank; change --mini or stack.micro_batch_size")
    seed = int(recipe.trainer.seed)
    tokens = sum(int(s.parts[0].num_tokens) for s in samples)
    print(f"[bench] batch: {n} completions ({recipe.trainer.prompts_per_step} prompts x {recipe.algorithm.group_size}), "
          f"{tokens} completion tokens, mean reward {sum(s.reward for s in samples) / n:.3f}; starting "
          f"{', '.join(c for c in configs if c != 'bare')} ...", flush=True)

    groups: dict[str, StackGroup] = {}
    try:
        t0 = time.perf_counter()
        for c in configs:
            ranks, distributed = CONFIGS[c]
            if ranks:
                groups[c] = StackGroup(c, ranks=ranks, distributed=distributed, samples=samples, seed=seed,
                                       threads=args.threads, sections=worker_sections(recipe, ranks=ranks, mini=mini))
        bare = BareLoop(recipe, samples, mini=mini) if "bare" in configs else None
        for g in groups.values():
            g.wait_ready()
        setup_s = time.perf_counter() - t0
        print(f"[bench] ready in {setup_s:.1f}s; warm-up {args.warmup} steps each, then {args.blocks} blocks of "
              f"{block_steps} steps, interleaved {' '.join(configs)}", flush=True)
        sched = Schedule(configs, groups, bare)
        for c in configs:
            sched.run(c, args.warmup, measured=False)
        for b in range(args.blocks):
            k = min(block_steps, args.steps - b * block_steps)
            if k <= 0:
                break
            for c in configs:
                sched.run(c, k, measured=True)
            print(f"[bench] block {b + 1}/{args.blocks}: "
                  + "  ".join(f"{c} {sched.blocks[c][-1]:.3f}s" for c in configs), flush=True)
    finally:
        for g in groups.values():
            g.close()

    load_end = os.getloadavg()[0]
    summary = sched.summary(n)
    rat, gaps = ratios(summary), same_math(summary, configs)
    measured = len(summary[configs[0]]["step_s"])
    print_report(summary, rat, gaps, configs, header=(
        f"Train step on one GRPO batch: {n} completions, {tokens} completion tokens; model {model_desc}; one optimizer "
        f"step per {mini} samples, micro-batches of {micro} per rank; torch threads per process {args.threads}\n"
        f"warm-up {args.warmup} steps each, then {args.blocks} blocks x {block_steps} steps per configuration, "
        f"interleaved; medians over {measured} measured steps"))
    print(f"setup {setup_s:.1f}s (spawn, build, FSDP2 wrap); total {time.perf_counter() - t_all:.1f}s; "
          f"1-min load average {load_start:.1f} at start, {load_end:.1f} at end ({os.cpu_count()} CPUs)")

    result = {
        "bench": "train_stack_scaling",
        "recipe": os.path.relpath(args.recipe, REPO) if str(args.recipe).startswith(str(REPO)) else args.recipe,
        "overrides": args.overrides,
        "model": model_desc,
        "samples_per_step": n,
        "completion_tokens": tokens,
        "mini_batch_global": mini,
        "micro_batch_per_rank": micro,
        "threads_per_process": args.threads,
        "warmup_steps": args.warmup,
        "blocks": args.blocks,
        "block_steps": block_steps,
        "schedule": sched.order,
        "configs": summary,
        "ratios": rat,
        "checks": gaps,
        "setup_s": setup_s,
        "total_wall_s": time.perf_counter() - t_all,
        "loadavg_1min": {"start": load_start, "end": load_end},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
    }
    line = json.dumps(result, sort_keys=True)
    print(line, flush=True)
    if args.json_out:
        Path(args.json_out).write_text(line + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
