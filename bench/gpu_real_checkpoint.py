"""The real-model diffusion recipes at full size on one GPU: load, wrap, sample, score, train, export.

Cases: Wan2.1 1.3B, SD3.5 Medium (Flow-GRPO and DiffusionNFT), FLUX.1-dev and Qwen-Image (Flow-GRPO, LoRA).

A prepared device check, not a CI test (CI has no GPU). For each case it writes (once per family) a
diffusers folder with the published architecture and random bf16 weights
(``unirl_ray.tools.random_checkpoint``), loads the UNCHANGED real recipe from ``recipes/diffusion/``
with ``PRETRAINED_MODEL`` pointing at that folder (overrides only shrink the batch to one GPU), and
drives the train rank the Ray Train worker would run (``StackWorker``: bundle from the folder, LoRA,
FSDP2 over a one-rank NCCL group, trainside rollout) through a few RL steps with the recipe's
reward functions scored in-process. It records load time, time per rollout and per train step, peak
GPU memory, the losses, ``rollout/logp_gap`` (rollout vs trainer log-probs at step start) and, for
the SD3.5 Flow-GRPO case, the colocated layout's offload / onload turn between steps and an export
that the diffusers class reloads.

Needs no Ray, MLflow or network. ``--tiny`` runs the same glue on the tiny recipe twins on the CPU
(a dry run of this script).

    python bench/gpu_real_checkpoint.py --json-out /tmp/gpu.json            # on a GPU machine
    python bench/gpu_real_checkpoint.py --tiny --steps 1                    # CPU dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SECTIONS = ("bundle", "pipeline", "backend", "algorithm", "stack", "rollout")
PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen", "a sailing boat"]

_TINY_PICKSCORE = "reward.rewards={pickscore: {fn: unirl_ray.rewards.image_model.PickScoreReward, kwargs: {tiny: true}}}"

# name -> (family, real recipe, tiny twin, overrides shrinking one step to one GPU, prompts, group size)
CASES: dict[str, dict[str, Any]] = {
    "wan2.1-1.3b-flowgrpo-lora": dict(
        family="wan2.1-t2v-1.3b", recipe="recipes/diffusion/wan/wan2_1_t2v_1_3b_flowgrpo.yaml",
        tiny="recipes/diffusion/wan/wan_tiny_flowgrpo.yaml", prompts=1, group=2,
        overrides=["algorithm.group_size=2", "stack.micro_batch_size=1", "stack.mini_batch_size=2",
                   "rollout.micro_batch_size=2"]),
    "sd3.5m-flowgrpo-lora": dict(
        family="sd3.5-medium", recipe="recipes/diffusion/sd3/sd3_5_medium_flowgrpo.yaml",
        tiny="recipes/diffusion/sd3/sd3_tiny_flowgrpo.yaml", prompts=2, group=4,
        overrides=["algorithm.group_size=4", "stack.micro_batch_size=4", "stack.mini_batch_size=8",
                   "rollout.micro_batch_size=8"], export=True, offload=True),
    "sd3.5m-nft": dict(
        family="sd3.5-medium", recipe="recipes/diffusion/sd3/sd3_5_medium_nft.yaml",
        tiny="recipes/diffusion/sd3/sd3_tiny_nft.yaml", prompts=2, group=4,
        overrides=["algorithm.group_size=4", "stack.micro_batch_size=4", "stack.mini_batch_size=null",
                   "rollout.micro_batch_size=8"]),
    # the PickScore reward of the FLUX / Qwen-Image recipes is swapped for a tiny random CLIP of the same class
    # (its weights are not on the device machine; the policy model's memory and step time are what is measured)
    "flux.1-dev-flowgrpo-lora": dict(
        family="flux.1-dev", recipe="recipes/diffusion/flux/flux1_dev_pickscore_flowgrpo.yaml",
        tiny="recipes/diffusion/flux/flux_tiny_flowgrpo.yaml", prompts=1, group=4,
        overrides=["algorithm.group_size=4", "stack.micro_batch_size=2", "stack.mini_batch_size=4",
                   "rollout.micro_batch_size=4", _TINY_PICKSCORE]),
    "qwen-image-flowgrpo-lora": dict(
        family="qwen-image", recipe="recipes/diffusion/qwen_image/qwen_image_pickscore_flowgrpo.yaml",
        tiny="recipes/diffusion/qwen_image/qwen_image_tiny_flowgrpo.yaml", prompts=1, group=4,
        overrides=["algorithm.group_size=4", "stack.micro_batch_size=2", "stack.mini_batch_size=4",
                   "rollout.micro_batch_size=4", _TINY_PICKSCORE]),
}


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def _requests(step: int, prompts: list[str], group: int) -> list[dict[str, Any]]:
    return [{"sample_id": f"s{step}-{p * group + g}", "group_id": f"s{step}-p{p}", "prompt": prompt, "columns": {},
             "seed": 1000 * step + p * group + g, "group_seed": 1000 * step + p}
            for p, prompt in enumerate(prompts) for g in range(group)]


def _score(reward_cfg: Any, samples: list[Any]) -> dict[str, float]:
    """The recipe's reward sources, in-process (the Serve app runs the same ``score_batch``)."""
    from unirl_ray.rewards.combine import combine, score_batch

    fns = {spec.name: spec.bound() for spec in reward_cfg.specs}
    per_source = score_batch(fns, [s.image for s in samples], [s.prompt for s in samples])
    totals = combine(per_source, reward_cfg.weights)
    for i, s in enumerate(samples):
        s.rewards = {name: values[i] for name, values in per_source.items()}
        s.reward = totals[i]
    vals = [t for t in totals if t is not None]
    return {"reward/mean": sum(vals) / max(len(vals), 1)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_case(name: str, case: dict[str, Any], *, folder: str | None, device: torch.device, steps: int,
             tiny: bool, export_dir: str | None) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from unirl_ray.config.recipe import instantiate, load_recipe
    from unirl_ray.train.rank import StackWorker
    from unirl_ray.train.configs import TrainTopology

    out: dict[str, Any] = {"case": name, "recipe": case["tiny"] if tiny else case["recipe"],
                           "overrides": case["overrides"]}
    if folder is not None:
        os.environ["PRETRAINED_MODEL"] = folder
    cfg = load_recipe(REPO / out["recipe"], case["overrides"])
    sections = {n: OmegaConf.to_container(cfg[n], resolve=True) for n in SECTIONS if cfg.get(n) is not None}
    reward_cfg = instantiate(cfg.reward)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    worker = StackWorker(sections, topology=TrainTopology(), device=device)
    _sync(device)
    out["load_and_wrap_s"] = round(time.perf_counter() - t0, 2)
    module = worker.backend.module
    out["trainable_params"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    out["fsdp2_wrapped"] = type(module).__name__.startswith("FSDP") or any(
        type(m).__name__.startswith("FSDP") for m in module.modules())
    if device.type == "cuda":
        out["resident_gib_after_load"] = _gib(torch.cuda.memory_allocated())
    out["steps"] = []
    prompts = (PROMPTS * 2)[: case["prompts"]]
    for step in range(1, steps + 1):
        rec: dict[str, Any] = {"step": step}
        if step > 1 and case.get("offload"):
            rec["offload"] = _offload_turn(worker, device)
        t0 = time.perf_counter()
        samples = worker.generate(_requests(step, prompts, case["group"]))
        _sync(device)
        rec["rollout_s"] = round(time.perf_counter() - t0, 2)
        rec["media_shape"] = list(samples[0].image.shape)
        rec |= _score(reward_cfg, samples)
        worker.algorithm.compute_advantages(samples)
        t0 = time.perf_counter()
        result = worker.train(samples, seed=step)
        _sync(device)
        rec["train_s"] = round(time.perf_counter() - t0, 2)
        rec["policy_version"] = result["policy_version"]
        metrics = result["metrics"]
        for key in ("train/loss", "train/grad_norm", "rollout/logp_gap", "algo/old_deviation", "train/optimizer_steps"):
            if key in metrics:
                rec[key] = float(metrics[key])
        if device.type == "cuda":
            rec["peak_gib"] = _gib(torch.cuda.max_memory_allocated())
        out["steps"].append(rec)
        print(f"[{name}] {json.dumps(rec)}", flush=True)
        bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise RuntimeError(f"step {step}: non-finite {bad}")
        if result["policy_version"] != step:
            raise RuntimeError(f"policy_version {result['policy_version']} after {step} steps")
    if export_dir is not None and case.get("export"):
        t0 = time.perf_counter()
        info = worker.export(export_dir, merge_lora=True)
        out["export_s"] = round(time.perf_counter() - t0, 2)
        reloaded = _reload_transformer(info.model_path)
        out["export_reloaded_params"] = sum(p.numel() for p in reloaded.parameters())
        out["export_model_path"] = os.path.relpath(info.model_path, export_dir)
        del reloaded
    del worker, module
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _offload_turn(worker: Any, device: torch.device) -> dict[str, float]:
    """The colocated layout's turn: the train state leaves the device (a colocated engine would
    generate now) and comes back bit for bit before the next step."""
    _sync(device)
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    off = worker.offload()
    after = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    on = worker.onload()
    if on["bytes"] != off["bytes"]:
        raise RuntimeError(f"offload moved {off['bytes']} bytes but onload restored {on['bytes']}")
    return {"offloaded_gib": _gib(off["bytes"]), "allocated_drop_gib": _gib(before - after),
            "resident_after_offload_gib": _gib(off["resident_bytes"])}


def _reload_transformer(path: str) -> torch.nn.Module:
    """The exported transformer through its diffusers class (merged LoRA: a plain model folder)."""
    import diffusers

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        class_name = json.load(f)["_class_name"]
    return getattr(diffusers, class_name).from_pretrained(path, local_files_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny recipe twins on the CPU (dry run)")
    parser.add_argument("--workdir", default=None, help="where the random checkpoints go (default: a temp dir)")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip cases that would start after this")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    import torch.distributed as dist

    from unirl_ray.tools.random_checkpoint import write_checkpoint

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port to take
    if device.type == "cuda":
        torch.cuda.set_device(0)
    work = args.workdir or tempfile.mkdtemp(prefix="unirl_gpu_check_")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "checkpoints": {}, "cases": []}
    start = time.perf_counter()
    folder: tuple[str, str] | None = None  # (family, path): one family's weights on disk at a time
    for name in args.cases:
        case = CASES[name]
        if time.perf_counter() - start > args.budget_s:
            report["cases"].append({"case": name, "skipped": "time budget"})
            continue
        try:
            family = case["family"]
            if not args.tiny and (folder is None or folder[0] != family):
                if folder is not None:
                    shutil.rmtree(folder[1], ignore_errors=True)
                    folder = None
                path = os.path.join(work, family)
                report["checkpoints"][family] = info = write_checkpoint(family, path)
                folder = (family, path)  # only once written in full
                print(f"[checkpoint] {json.dumps(info)}", flush=True)
            export_dir = os.path.join(work, f"export-{name}")
            report["cases"].append(run_case(name, case, folder=None if args.tiny else folder[1], device=device,
                                            steps=args.steps, tiny=args.tiny, export_dir=export_dir))
            shutil.rmtree(export_dir, ignore_errors=True)
        except Exception as exc:
            traceback.print_exc()
            report["cases"].append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            if args.json_out:
                with open(args.json_out, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=1)
    dist.destroy_process_group()
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    sys.exit(1 if any("error" in c for c in report["cases"]) else 0)


if __name__ == "__main__":
    main()
