"""Sampling speed of the tiny SD3 pipeline: the Flow-GRPO SDE, the ODE and CFG, at several batch sizes.

A benchmark, not a test: it asserts nothing about speed. One process builds the tiny demo SD3 (offline,
``SD3Bundle`` from the default ``SD3PipelineConfig``) and times ``SD3Pipeline.sample`` (prompt encoding,
the denoising loop with its per-step log-probs, VAE decoding) for each variant and batch size:

  sde  every step an SDE step (Flow-GRPO, the default);
  ode  ``sde_window_size=0``: deterministic Euler steps, log-probs NaN (DiffusionNFT's sampling);
  cfg  the SDE with classifier-free guidance (``guidance_scale`` 4.5: a second, negative-prompt pass);

and, for each batch size, ``encode_prompts`` and ``decode`` alone (what ``sample`` spends outside its
denoising loop). After ``--warmup`` unmeasured rounds, ``--rounds`` rounds each call every case once,
the order rotated from round to round; it prints the median and fastest seconds per call of each case,
milliseconds per sample, each case's ratio to the first case, and each variant's per-sample time
relative to its smallest batch.

    python bench/sd3_sampling.py                                # ~20 s on 2 busy cores (half of it building)
    python bench/sd3_sampling.py --steps 10 --size 64 --batches 1,4,8 --json-out /tmp/sd3_sampling.json
    python bench/sd3_sampling.py --variants sde --batches 1 --rounds 3 --warmup 1   # a few seconds

See bench/README.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from _common import (  # noqa: E402  (bench/ is on sys.path when run as a script)
    finish_report, fmt_num, loadavg_1min, median, offline_env, print_table,
)

offline_env()

import torch  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {"sde": {}, "ode": {"sde_window_size": 0}, "cfg": {"guidance_scale": 4.5}}
PROMPTS = ["a red cat", "a blue dog", "a tree", "a bright sky", "a dark room", "a green field", "a white boat",
           "a black car"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)} (default all)")
    ap.add_argument("--batches", default="1,2,4", help="comma-separated prompts per sample call (default 1,2,4)")
    ap.add_argument("--steps", type=int, default=4, help="num_inference_steps (default 4)")
    ap.add_argument("--size", type=int, default=32, help="image height = width in pixels, a multiple of 4 (default 32)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    ap.add_argument("--rounds", type=int, default=15, help="measured rounds, each calling every case once (default 15)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default for this machine)")
    ap.add_argument("--json-out", default=None, help="also write the JSON result line to this file")
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or set(args.variants) - set(VARIANTS):
        ap.error(f"--variants takes names from {', '.join(VARIANTS)}")
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        ap.error("--batches takes comma-separated whole numbers")
    if not args.batches or min(args.batches) < 1 or min(args.steps, args.size, args.rounds) < 1 or args.warmup < 0:
        ap.error("--batches, --steps, --size and --rounds must be >= 1, --warmup >= 0")
    return args


def build_cases(args) -> dict[str, tuple[str, int, Callable[[int], None]]]:
    """``{label: (variant or stage, batch, call(round))}``: every variant x batch, then encode / decode per batch."""
    from unirl_ray.models.sd3 import SD3Bundle, SD3Pipeline, SD3PipelineConfig

    bundle = SD3Bundle.from_config(SD3PipelineConfig())
    pipes = {v: SD3Pipeline(bundle, num_inference_steps=args.steps, height=args.size, width=args.size, **VARIANTS[v])
             for v in args.variants}
    base = next(iter(pipes.values()))

    def prompts(b: int) -> list[str]:
        return [PROMPTS[i % len(PROMPTS)] for i in range(b)]

    def sample(pipe, b: int) -> Callable[[int], None]:
        return lambda r: pipe.sample(prompts(b), [r * b + i for i in range(b)])

    def encode(b: int) -> Callable[[int], None]:
        return lambda r: base.encode_prompts(prompts(b))

    def decode(b: int) -> Callable[[int], None]:
        latents = torch.randn(b, *base.latent_shape, generator=torch.Generator().manual_seed(b))
        return lambda r: base.decode(latents)

    cases = {f"{v} b{b}": (v, b, sample(pipe, b)) for v, pipe in pipes.items() for b in args.batches}
    cases |= {f"encode b{b}": ("encode", b, encode(b)) for b in args.batches}
    cases |= {f"decode b{b}": ("decode", b, decode(b)) for b in args.batches}
    return cases


def run_rounds(args, cases) -> tuple[dict[str, list[float]], list[list[str]]]:
    """Warm-up rounds, then the measured ones; every round calls each case once, the order rotated."""
    labels = list(cases)
    times: dict[str, list[float]] = {k: [] for k in labels}
    orders: list[list[str]] = []
    for r in range(args.warmup + args.rounds):
        k = r % len(labels)
        order = labels[k:] + labels[:k]
        for label in order:
            t0 = time.perf_counter()
            cases[label][2](r)
            if r >= args.warmup:
                times[label].append(time.perf_counter() - t0)
        if r >= args.warmup:
            orders.append(order)
    return times, orders


def summarise(cases, times: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    labels = list(cases)
    first = median(times[labels[0]])
    smallest: dict[str, float] = {}  # per variant / stage: seconds per sample at its smallest batch
    out: dict[str, dict[str, Any]] = {}
    for label in labels:
        kind, b, _ = cases[label]
        med = median(times[label])
        smallest.setdefault(kind, med / b)
        out[label] = {"kind": kind, "batch": b, "median_s": med, "min_s": min(times[label]),
                      "per_sample_median_s": med / b, "ratio_to_first": med / first,
                      "per_sample_ratio_to_smallest_batch": (med / b) / smallest[kind], "s": times[label]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    load_start = loadavg_1min()
    cases = build_cases(args)
    print(f"[bench] built the tiny SD3 in {time.perf_counter() - t_all:.1f}s; {args.warmup} warm-up and "
          f"{args.rounds} measured rounds of {len(cases)} cases", flush=True)
    times, orders = run_rounds(args, cases)
    stats = summarise(cases, times)

    first = next(iter(stats))
    print()
    print(f"tiny SD3 sampling: {args.steps} steps at {args.size}x{args.size}, torch threads {torch.get_num_threads()}; "
          f"medians over {args.rounds} rounds (each calls every case once, order rotated)")
    rows = [[label, fmt_num(st["median_s"], 8, 4), fmt_num(st["min_s"], 8, 4),
             fmt_num(st["per_sample_median_s"] * 1e3, 8, 1), fmt_num(st["ratio_to_first"], 7, 2),
             fmt_num(st["per_sample_ratio_to_smallest_batch"], 8, 2)] for label, st in stats.items()]
    print_table(["case", "s/call", "min s", "ms/smp", f"x {first}", f"smp x b{args.batches[0]}"], rows,
                [10, 8, 8, 8, 9, 8], gap=2)
    print(f"  s/call, min s: median and fastest seconds per call; ms/smp: median ms per sample; x {first}: median "
          f"s/call over that of {first}; smp x b{args.batches[0]}: per-sample time over that of the same row kind at the smallest batch "
          f"({args.batches[0]}); encode / decode: the prompt encoders and the VAE decoder alone (parts of every sample call)")
    result = {"bench": "sd3_sampling", "variants": args.variants, "batches": args.batches, "steps": args.steps,
              "size": args.size, "warmup_rounds": args.warmup, "rounds": args.rounds,
              "torch_threads": torch.get_num_threads(), "first_round_order": orders[0], "cases": stats}
    finish_report(result, load_start, t_all, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
