"""Weight sync: publish + verified load on every engine replica, in GB/s, beside the object store and a memcpy.

A benchmark, not a test: it asserts nothing about speed. Each case is a real AR trainer (one Ray Train
worker, FSDP2) with a dedicated HF engine app of 1 or 2 replicas on Ray Serve, its model a Qwen2 of
~10M, ~100M or ~500M parameters built from config, trained in full or as LoRA adapters. After
``setup()`` (which pushes version 0), ``trainer.publish_weights()`` runs ``--repeats`` times: the path
every sync of a run takes (rank 0 gathers the weights and puts them in the object store once, every
replica loads them and reports the checksum, the driver checks it).

In the same run, on the same bytes (the sizes the sync reported), two yardsticks:

  object store  ``ray.put`` of the same arrays in one process + ``ray.get`` in as many other processes as
                the engine has replicas, at once (actors that copy every byte into memory they hold:
                what a load must at least do);
  memcpy        one copy of the same bytes into memory that is already mapped.

    python bench/weight_sync.py                          # 10M, 100M, 500M; full and LoRA; 1 and 2 replicas
    python bench/weight_sync.py --sizes 10M --modes full --replicas 1 --repeats 5 --json-out /tmp/sync.json
    python bench/weight_sync.py --through-driver         # the path without a store, for comparison

Medians over the repeats (``--gap`` seconds apart, as the train steps between two syncs would leave); see bench/README.md for the figures and what they say.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from _common import finish_report, fmt_num, loadavg_1min, median, offline_env, print_table  # noqa: E402

RECIPE = str(Path(__file__).resolve().parent.parent / "recipes" / "ar" / "tiny" / "char_grpo_engine.yaml")
# Qwen2 shapes (head_dim 64) of about the named sizes with the char tokenizer's tiny vocabulary
SIZES = {
    "10M": {"hidden_size": 512, "num_layers": 3, "num_attention_heads": 8, "intermediate_size": 1536},
    "100M": {"hidden_size": 1024, "num_layers": 7, "num_attention_heads": 16, "intermediate_size": 3072},
    "500M": {"hidden_size": 2048, "num_layers": 9, "num_attention_heads": 32, "intermediate_size": 5632},
}
LORA = ("backend.lora_cfg={_target_: unirl_ray.train.configs.LoraConfig, rank: 16, alpha: 32, "
        "target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}")


def trainer_for(size: str, mode: str, replicas: int, storage: str):
    from unirl_ray.config.recipe import load_recipe
    from unirl_ray.trainer.ar import ARTrainer

    tiny = ", ".join(f"{k}: {v}" for k, v in SIZES[size].items())
    overrides = [
        f"trainer.storage_path={storage}", f"trainer.run_name=sync-{size}-{mode}-{replicas}",
        "tracking.log_samples_every=0", "tracking.experiment_name=bench-weight-sync",
        f"+bundle.config.tiny={{_target_: unirl_ray.models.causal_lm.TinyLMConfig, {tiny}}}",
        "ray.scaling.num_workers=1", "ray.scaling.resources_per_worker.CPU=1",
        f"rollout.num_replicas={replicas}", "rollout.ray_actor_options.num_cpus=0.5",
        *([LORA] if mode == "lora" else []),
    ]
    return ARTrainer(load_recipe(RECIPE, overrides))


def sync_case(size: str, mode: str, replicas: int, repeats: int, through_driver: bool, gap: float) -> dict[str, float]:
    """Seconds of each publish (and its export part) and the bytes moved, medians over ``repeats``."""
    from _common import fresh_setup

    with tempfile.TemporaryDirectory(prefix="sync_") as storage:
        trainer = trainer_for(size, mode, replicas, storage)
        status = "FAILED"
        try:
            fresh_setup(trainer)  # deploys the engine, starts the worker, pushes v0
            if through_driver:  # the path of an engine without a weight store: rank 0 -> driver -> object store
                trainer.engine.store_id = None
            trainer.publish_weights()  # warm-up: the first publish of a path maps its memory
            runs = []
            for _ in range(repeats):
                time.sleep(gap)  # a train step between two syncs: the previous version's memory is freed
                runs.append(trainer.publish_weights())
            status = "FINISHED"
        finally:
            trainer.teardown(status)
    seconds = median([m["weight_sync/seconds"] for m in runs])
    out = {"bytes": runs[0]["weight_sync/bytes"], "seconds": seconds,
           "export_s": median([m["weight_sync/export_seconds"] for m in runs]),
           **{k: median([m.get(f"weight_sync/{k}", float("nan")) for m in runs])
              for k in ("gather_s", "checksum_s", "put_s", "replica_load_s")},
           "spread": (min(m["weight_sync/seconds"] for m in runs), max(m["weight_sync/seconds"] for m in runs))}
    out["load_s"] = seconds - out["export_s"]
    return out


def yardsticks(nbytes: int, repeats: int, readers: int, gap: float) -> dict[str, float]:
    """Seconds of a ``ray.put`` + a reading ``ray.get`` in ``readers`` other processes at once (one per engine
    replica), and of a memcpy, of ``nbytes``."""
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Reader:
        def read(self, arrays: dict) -> int:  # the arrays arrive zero-copy (mapped from the object store)
            return int(sum(a.nbytes for a in arrays.values()))

        def read_all(self, arrays: dict) -> int:  # every byte copied once into resident memory, as a load
            if not hasattr(self, "dst"):  # one reader per case: the same arrays every call
                self.dst = {k: np.ones_like(a) for k, a in arrays.items()}  # the engine's weights: mapped
            for k, a in arrays.items():
                np.copyto(self.dst[k], a)
            return int(sum(a.nbytes for a in arrays.values()))

    chunk = 64 << 20
    sizes = [min(chunk, nbytes - i) for i in range(0, nbytes, chunk)]
    arrays = {f"t{i}": np.random.default_rng(i).integers(0, 255, s, dtype=np.uint8) for i, s in enumerate(sizes)}
    group = [Reader.remote() for _ in range(readers)]
    ray.get([r.read_all.remote(ray.put(arrays)) for r in group], timeout=600)  # warm: the destinations are mapped
    store, store_copy, memcpy = [], [], []
    for _ in range(repeats):
        time.sleep(gap)
        t0 = time.perf_counter()
        ref = ray.put(arrays)
        assert ray.get([r.read.remote(ref) for r in group], timeout=600) == [nbytes] * readers
        store.append(time.perf_counter() - t0)
        del ref
        time.sleep(gap)
        t0 = time.perf_counter()
        ref = ray.put(arrays)
        assert ray.get([r.read_all.remote(ref) for r in group], timeout=600) == [nbytes] * readers
        store_copy.append(time.perf_counter() - t0)
        del ref
        dst = {k: np.ones_like(a) for k, a in arrays.items()}  # mapped before the clock starts
        t0 = time.perf_counter()
        for k, a in arrays.items():
            np.copyto(dst[k], a)
        memcpy.append(time.perf_counter() - t0)
        del dst
    for r in group:
        ray.kill(r)
    return {"store_s": median(store), "store_copy_s": median(store_copy), "memcpy_s": median(memcpy)}


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10M,100M,500M", help="comma-separated, of: " + ", ".join(SIZES))
    parser.add_argument("--modes", default="full,lora", help="full, lora")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gap", type=float, default=0.5,
                        help="seconds between two measured syncs (and two yardstick puts), as a train step would "
                             "leave: the object store frees the previous version's memory meanwhile, so the next put "
                             "reuses it instead of mapping new pages (0: back to back)")
    parser.add_argument("--through-driver", action="store_true",
                        help="the weights come back through the driver, which puts them (the path without a store)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    offline_env()
    sizes, modes = args.sizes.split(","), args.modes.split(",")
    replicas = [int(r) for r in args.replicas.split(",")]
    bad = [s for s in sizes if s not in SIZES] + [m for m in modes if m not in ("full", "lora")]
    if bad:
        parser.error(f"unknown sizes/modes {bad}")
    load_start, t_all = loadavg_1min(), time.perf_counter()
    import ray

    ray.init(num_cpus=8, include_dashboard=False)
    cases, rows = [], []
    for size in sizes:
        for mode in modes:
            for n in replicas:
                case = {"size": size, "mode": mode, "replicas": n, **sync_case(size, mode, n, args.repeats, args.through_driver, args.gap)}
                case.update(yardsticks(int(case["bytes"]), args.repeats, n, args.gap))
                cases.append(case)
                b = case["bytes"]
                sync, store = gbps(b, case["seconds"]), gbps(b, case["store_copy_s"])
                rows.append([size, mode, str(n), fmt_num(b / 1e6, 8, 1), fmt_num(case["seconds"], 7, 3),
                             *(fmt_num(case[k], 7, 3) for k in ("gather_s", "checksum_s", "put_s", "replica_load_s")),
                             fmt_num(sync, 6, 2), fmt_num(store, 6, 2),
                             fmt_num(gbps(b, case["store_s"]), 6, 2), fmt_num(gbps(b, case["memcpy_s"]), 6, 2),
                             fmt_num(sync / store if store == store else None, 5, 2)])
                print(f"{size} {mode} x{n}: {case['seconds']:.3f}s for {b / 1e6:.1f} MB "
                      f"({sync:.2f} GB/s; object store + read {store:.2f} GB/s)", flush=True)
    ray.shutdown()
    print("\nmedians over", args.repeats, f"publishes after a warm-up one, {args.gap:g} s apart (seconds: the whole sync, and on rank 0 "
          "gathering the weights, their checksum, the put; load: the slowest replica's checksum + copy into its "
          "weights; GB/s of the weights' bytes; 'store+read': ray.put + a ray.get in one other process per replica "
          "that copies every byte into resident memory; 'store': ray.put + a zero-copy ray.get; ratio: sync / store+read)")
    print_table(["size", "mode", "repl", "MB", "sync_s", "gather", "cksum", "put", "load", "sync", "store+read",
                 "store", "memcpy", "ratio"], rows, [5, 5, 4, 8, 7, 7, 7, 7, 7, 6, 10, 6, 6, 5])
    finish_report({"cases": cases, "gap_s": args.gap}, load_start, t_all, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
