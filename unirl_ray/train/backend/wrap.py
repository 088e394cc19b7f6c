"""FSDP2 wrap of a module, in a fixed order: activation checkpointing, then ``fully_shard`` on
every block, then on the root (which takes the leftover parameters: embeddings, norms, heads)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unirl_ray.core.dtypes import TORCH_DTYPES
from unirl_ray.train.configs import FSDPConfig


def build_mesh(cfg: FSDPConfig, device: torch.device) -> Any:
    """The device mesh of ``cfg.fsdp_mode`` over the current process group.

    1-D ``("shard",)`` for ``full``; 2-D ``("replicate", "shard")`` for ``hybrid`` (HSDP) and for
    ``no_shard`` (HSDP with shard groups of one rank).
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = cfg.mesh_shape(dist.get_world_size())  # raises ValueError on a bad hsdp_shard_size
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def fsdp_kwargs(cfg: FSDPConfig, mesh: Any, device: torch.device) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[cfg.param_dtype], reduce_dtype=TORCH_DTYPES[cfg.reduce_dtype])
    kwargs: dict[str, Any] = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    if cfg.cpu_offload:
        # Pinned host memory needs a CUDA runtime; on a CPU-only machine plain memory is the only kind.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    return kwargs


def apply_fsdp(module: nn.Module, *, cfg: FSDPConfig, mesh: Any, device: torch.device, block_class_names: list[str]) -> None:
    """Shard ``module`` in place: each block of a class in ``block_class_names``, then the root."""
    from torch.distributed.fsdp import fully_shard

    kwargs = fsdp_kwargs(cfg, mesh, device)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(module, block_class_names)
    for block in _blocks(module, block_class_names):
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)


def apply_activation_checkpointing(module: nn.Module, block_class_names: list[str]) -> None:
    """Recompute each block's activations in backward instead of keeping them (before any ``fully_shard``)."""
    from torch.distributed._composable import checkpoint

    for block in _blocks(module, block_class_names):
        checkpoint(block)


def _blocks(module: nn.Module, block_class_names: list[str]) -> list[nn.Module]:
    return [m for m in module.modules() if type(m).__name__ in block_class_names]


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """Every sharded module (the root's ``reshard()`` does not reach its blocks)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard_all(module: nn.Module) -> None:
    """Free every gathered (unsharded) parameter, so the next forward gathers the shards again."""
    for m in fsdp_modules(module):
        m.reshard()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (a view sharing its storage); the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def gathered_forwards(module: nn.Module) -> Iterator[bool]:
    """No-grad forwards of ``module`` without FSDP2's per-call hooks: every sharded module is gathered
    once on entry (``unshard``: a collective, the same on every rank) and its forward pre- and post-hooks
    are set aside until exit, so each call runs the plain module on the gathered weights. Yields whether
    it did; the caller reshards on exit.

    Decoding calls the model once per token, and on a small model FSDP2's hooks (input casting, state
    bookkeeping, the unsharded-state checks of every sharded module) cost more than the forward itself
    (the tiny demo LM on CPU: 38 ms instead of 27 ms per 16 samples). They do nothing a no-grad forward on
    gathered weights needs when nothing is cast: the gathered parameters are the module's own while
    gathered, and inputs are placed by the pipeline (as for a rollout-only side's plain module). Falls
    back to the hooked forwards (yields False) with gradients enabled (a backward through gathered
    weights would bypass the sharded parameters), when the mixed-precision policy casts (a param_dtype
    other than float32 parameters in float32, an output_dtype), or for modules sharded as a group."""
    from torch.utils.hooks import RemovableHandle

    sharded = fsdp_modules(module)
    all_float32 = all(p.dtype == torch.float32 for p in module.parameters())  # every sharded module's, at once
    hooks: list[tuple[nn.Module, tuple[int, ...]]] = []
    for m in sharded:
        state = m._get_fsdp_state()
        pre, post = getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None)
        policy = getattr(state, "_mp_policy", None)
        # FSDP2 casts inputs (and parameters) to param_dtype: skipped only where that changes nothing
        casts = policy is None or policy.output_dtype is not None or (policy.param_dtype is not None and (
            policy.param_dtype != torch.float32 or not all_float32))
        if casts or not (isinstance(pre, RemovableHandle) and isinstance(post, RemovableHandle)):
            hooks = []
            break
        hooks.append((m, (pre.id, post.id)))
    if not hooks or torch.is_grad_enabled():
        yield False
        return
    for m in sharded:
        m.unshard()
    saved: list[tuple[dict, list[tuple[int, Any]]]] = []
    try:
        for m, ids in hooks:
            for table in (m._forward_pre_hooks, m._forward_hooks):
                saved.append((table, list(table.items())))
                for hook_id in ids:
                    table.pop(hook_id, None)
        yield True
    finally:
        for table, items in saved:  # the original order (FSDP's pre-hook runs first), then any added meanwhile
            known = {key for key, _ in items}
            added = [(key, hook) for key, hook in table.items() if key not in known]
            table.clear()
            table.update(items)
            table.update(added)
