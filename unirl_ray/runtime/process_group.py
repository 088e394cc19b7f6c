"""The torch process group of a train run, set up by a backend config the Ray Train controller can hold
without importing torch.

Ray Train keeps a run's backend config in its controller actor, and ``ray.train.torch.TorchConfig``'s
module imports torch: every run's controller then spends about 2 CPU-seconds importing torch (on the
2-core machine, before it creates the workers, so on the critical path of every start) for nothing it
uses. ``ProcessGroupConfig`` is a drop-in for it (passed as ``TorchTrainer(torch_config=...)``) whose
module imports only Ray Train's ``BackendConfig``; what touches torch runs on the workers, where torch is
loaded anyway. It does what ``TorchConfig`` does with ``init_method="env"`` for gloo and nccl: rank 0's
address and a free port as ``MASTER_ADDR`` / ``MASTER_PORT``, the torchrun variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ...), ``init_process_group`` on every rank with the collective timeout,
and on shutdown the group destroyed and the CUDA cache emptied.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
SHUTDOWN_TIMEOUT_S = 30.0


@dataclass
class ProcessGroupConfig(BackendConfig):
    """The process group of a train run's workers (built by ``TrainGroup`` from the ``ray:`` block)."""

    backend: str = "gloo"
    """``gloo`` (CPU) or ``nccl`` (CUDA)."""
    timeout_s: int = 1800
    """Collective timeout: a lost rank fails the step after this instead of hanging (``ray.collective_timeout_s``)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"process group backend must be one of {BACKENDS}, got {self.backend!r}")

    @property
    def backend_cls(self) -> type:
        return ProcessGroupBackend

    @property
    def train_func_context(self) -> Any:
        return _CudaDevice

    @property
    def framework(self) -> Any:
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class _CudaDevice:
    """Around the train function on each worker: its CUDA device is the current one (as ``TorchConfig``'s)."""

    def __enter__(self) -> None:
        import torch

        if torch.cuda.is_available():
            import ray.train.torch

            device = ray.train.torch.get_device()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc: Any) -> bool:
        return False


def _set_env(addr: str, port: int) -> None:
    """On a worker: where rank 0 listens, and the torchrun variables of this rank."""
    from ray.train import get_context

    ctx = get_context()
    os.environ.update({
        "MASTER_ADDR": addr, "MASTER_PORT": str(port),
        "RANK": str(ctx.get_world_rank()), "WORLD_SIZE": str(ctx.get_world_size()),
        "LOCAL_RANK": str(ctx.get_local_rank()), "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
        "NODE_RANK": str(ctx.get_node_rank()),
    })


def _init(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    """On a worker: join the process group."""
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "nccl":  # a collective that times out fails instead of hanging
        if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    dist.init_process_group(backend=backend, init_method="env://", rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _shutdown(destroy: bool) -> None:
    """On a worker: leave the process group, free the CUDA cache."""
    import torch
    import torch.distributed as dist

    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class ProcessGroupBackend(Backend):
    share_cuda_visible_devices: bool = True  # as TorchConfig's: a rank may address its node's other GPUs

    def on_start(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_env, addr=addr, port=port)
        world = len(worker_group)
        # each join is bounded by the collective timeout itself; the wait for all of them a minute beyond it
        ray.get([worker_group.execute_single_async(i, _init, backend=backend_config.backend, world_rank=i, world_size=world,
                                                   timeout_s=backend_config.timeout_s) for i in range(world)],
                timeout=backend_config.timeout_s + 60)

    def on_shutdown(self, worker_group: Any, backend_config: ProcessGroupConfig) -> None:
        futures = worker_group.execute_async(_shutdown, destroy=len(worker_group) > 1)
        try:
            ray.get(futures, timeout=SHUTDOWN_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            log.warning("the torch process group did not shut down within %.0fs", SHUTDOWN_TIMEOUT_S)
