"""Backend checkpoint helpers: RNG states, the LR schedule, optional entries, AdamW state.

RNG states differ per rank, so each rank stores its own under ``rng.rank<r>`` in the DCP
checkpoint (tensors only; DCP writes every rank's distinct keys). The schedule is the same on every
rank and goes into the JSON-able meta dict that ``FSDPBackend.save`` returns.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def rng_key(rank: int) -> str:
    return f"rank{rank}"


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's torch generator states: CPU always, the CUDA device's when training on one."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """JSON-able state of the schedule (the lambdas are rebuilt from the config)."""
    return {
        "last_epoch": int(scheduler.last_epoch),
        "step_count": int(scheduler._step_count),
        "base_lrs": [float(x) for x in scheduler.base_lrs],
        "last_lr": [float(x) for x in scheduler.get_last_lr()],
    }


def load_scheduler_state(
    scheduler: torch.optim.lr_scheduler.LambdaLR, meta: dict[str, Any], factor: Any
) -> None:
    """Restore the schedule position and the current learning rates.

    With the same peak learning rates as when saved, the saved rates are set exactly (JSON keeps
    Python floats exact); if the recipe changed them, the rates are recomputed from the new peaks.
    """
    optimizer = scheduler.optimizer
    state = meta["scheduler"]
    scheduler.last_epoch = int(state["last_epoch"])
    scheduler._step_count = int(state["step_count"])
    current = [float(x) for x in scheduler.base_lrs]
    if state["base_lrs"] == current:
        lrs = list(state["last_lr"])
    else:
        log.warning("learning rates changed since the checkpoint (%s -> %s): schedule rescaled",
                    state["base_lrs"], current)
        lrs = [base * factor(scheduler.last_epoch) for base in current]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)


def drop_absent(state: dict[str, Any], stored: set[str], *, rank: int, adapter_shadow: set[str]) -> set[str]:
    """Remove from a DCP ``state`` the optional entries the checkpoint lacks: this rank's RNG
    (saved with fewer ranks, or without this device's generator) and EMA shadows (an EMA added since).
    Returns the EMAs (``"full"``, ``"lora"``) that must restart from the loaded weights."""
    restart: set[str] = set()
    rng = state["rng"][rng_key(rank)]
    for name in list(rng):
        if f"rng.{rng_key(rank)}.{name}" not in stored:
            del rng[name]
    if "cpu" not in rng:
        log.warning("checkpoint has no RNG state for rank %d (saved with fewer ranks or without RNG): "
                    "RNG not restored", rank)
        del state["rng"]
    if "ema" in state and not any(k.startswith("ema.") for k in stored):
        del state["ema"]
        restart.add("full")
    if adapter_shadow and not any(f"model.{n}" in stored for n in adapter_shadow):
        state["model"] = {k: v for k, v in state["model"].items() if k not in adapter_shadow}
        restart.add("lora")
    return restart


def init_adamw_state(optimizer: torch.optim.Optimizer) -> None:
    """Materialise AdamW's lazily created state (zeros) so DCP has tensors to load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
