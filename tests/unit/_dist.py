"""Helpers for backend tests: a tiny model, a deterministic train loop, and a 2-rank gloo runner.

Multi-rank tests start ranks with ``torch.multiprocessing`` (gloo on CPU, no Ray). A rank runs a
module-level function and returns a picklable value (tensors included) that the test then checks.

Ranks are forked from one forkserver per test session that imported torch and the backend once
(``start_ranks``): a spawned rank would import them again each time (~3 CPU-seconds per rank, a
busy core for most of a two-rank test). The server never runs torch itself (no thread pools to
inherit), so the forked ranks start as clean as spawned ones; like spawned ones, they see the
environment and ``sys.path`` of the test process as it was when the server started.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from unirl_ray.train.backend.fsdp import FSDPBackend
from unirl_ray.train.configs import OptimizerConfig, TrainTopology

DIM = 5  # odd on purpose: 2 ranks get uneven shards (FSDP2 pads the second one)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.to_q(x).tanh())


class Net(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, 3)  # a root-level parameter (sharded with the root)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Bundle:
    def __init__(self, dim: int = DIM) -> None:
        torch.manual_seed(0)
        self.net = Net(dim)


def make_backend(
    *, needs_reference: bool = False, lr: float = 0.05, dim: int = DIM, device: str = "cpu", **kwargs: Any
) -> FSDPBackend:
    """A set-up backend over a fresh ``Net`` (sharded when a process group exists)."""
    backend = FSDPBackend(
        block_class_names=["Block"],
        trainable_attr="net",
        optimizer_cfg=kwargs.pop("optimizer_cfg", OptimizerConfig(learning_rate=lr)),
        bundle=Bundle(dim),
        **kwargs,
    )
    backend.setup(topology=TrainTopology.from_env(), device=torch.device(device), needs_reference=needs_reference)
    return backend


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def backward(backend: FSDPBackend, step: int, *, noise: bool = False, global_batch: int = 8) -> float:
    """Forward + backward of step ``step``: a global batch fixed by the step index, split over ranks.

    Each rank's loss is a mean over its slice and FSDP2 averages gradients over ranks, so the
    gradient equals the single-process one on the whole batch. ``noise`` draws from the global
    torch generator, which an exact resume must restore.
    """
    rank, world = rank_world()
    per = global_batch // world
    dim = backend.module.head.in_features
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch, dim, generator=g)[rank * per : (rank + 1) * per].to(backend.device)
    target = torch.randn(global_batch, 3, generator=g)[rank * per : (rank + 1) * per].to(backend.device)
    out = backend.module(x)
    if noise:
        out = out + 0.1 * torch.randn_like(out)
    loss = (out - target).pow(2).mean()
    loss.backward()
    return loss.item()


def train(backend: FSDPBackend, steps: int, *, start: int = 0, noise: bool = False) -> list[float]:
    """``steps`` optimizer steps (indices ``start``...), each on its own fixed global batch."""
    losses = []
    for step in range(start, start + steps):
        losses.append(backward(backend, step, noise=noise))
        backend.optimizer_step(max_grad_norm=1.0)
    return losses


def full_params(backend: FSDPBackend, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Collective: every parameter gathered to full tensors (on every rank)."""
    out = {}
    for name, p in backend.module.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        out[name] = full(p)
    return out


def full(t: torch.Tensor) -> torch.Tensor:
    """Collective for DTensors: the full tensor, detached and cloned."""
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().clone()


def free_port() -> int:
    """A free TCP port for a torch.distributed rendezvous, outside the range other processes take ports from
    meanwhile (``support.free_ports``)."""
    from support import free_port as port

    return port()


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # The result is on disk: leave without the interpreter's teardown, where a gloo background thread
    # still joinable at exit once aborted a rank ("terminate called without an active exception").
    os._exit(0)


PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
           "unirl_ray.train.backend.fsdp", "unirl_ray.train.rank", "_dist"]


def start_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, the ranks forked from the session's forkserver
    (see the module docstring); raises as ``spawn`` does when a rank fails."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; returns each rank's return value."""
    with tempfile.TemporaryDirectory() as out_dir:
        start_ranks(_entry, (world_size, free_port(), fn, args, out_dir), world_size)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
