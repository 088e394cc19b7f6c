"""``FSDPBackend``: owns the trainable model on a train rank.

Order of construction (``setup``), as the seed prescribes: pick the trainable module from the
bundle, structural injection (LoRA via peft) with the same seed on every rank, a frozen reference
copy when the algorithm needs one, FSDP2 ``fully_shard`` on every configured block class then on
the root, then the optimizer and LR schedule. Without an initialised process group (a single
process, e.g. unit tests or the bare benchmark) the module is used unwrapped.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from unirl_ray.core.dtypes import TORCH_DTYPES
from unirl_ray.train.backend import dcp_io
from unirl_ray.train.backend.lora import inject_lora
from unirl_ray.train.configs import (
    FSDPConfig,
    LoraConfig,
    LrSchedulerConfig,
    OptimizerConfig,
    TrainTopology,
)

log = logging.getLogger(__name__)



class FSDPBackend:
    """The trainable model, its optimizer / schedule, and its checkpoint."""

    def __init__(
        self,
        *,
        block_class_names: list[str],
        trainable_attr: str,
        fsdp_cfg: FSDPConfig | None = None,
        optimizer_cfg: OptimizerConfig | None = None,
        lr_scheduler_cfg: LrSchedulerConfig | None = None,
        lora_cfg: LoraConfig | None = None,
        seed: int = 0,
        bundle: Any = None,
    ) -> None:
        if not block_class_names:
            raise ValueError("FSDPBackend.block_class_names is empty: name the transformer block class(es) to shard")
        self.block_class_names = list(block_class_names)
        self.trainable_attr = trainable_attr
        self.fsdp_cfg = fsdp_cfg or FSDPConfig()
        self.optimizer_cfg = optimizer_cfg or OptimizerConfig()
        self.lr_scheduler_cfg = lr_scheduler_cfg or LrSchedulerConfig()
        self.lora_cfg = lora_cfg
        self.seed = seed
        self.bundle = bundle
        self.module: nn.Module | None = None
        self.reference_module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.optimizer_steps = 0
        self.topology = TrainTopology()
        self.device = torch.device("cpu")

    # ------------------------------------------------------------------ setup
    def setup(self, *, topology: TrainTopology, device: torch.device, needs_reference: bool = False) -> None:
        """Build the trainable module on ``device``; collective when a process group exists."""
        if self.bundle is None:
            raise ValueError("FSDPBackend needs bundle=... (the trainer passes the built bundle)")
        module = getattr(self.bundle, self.trainable_attr, None)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"FSDPBackend.trainable_attr={self.trainable_attr!r}: the bundle has no nn.Module attribute by that name"
            )
        self.topology, self.device = topology, device
        self._check_block_classes(module)
        module.to(device)
        module.requires_grad_(False)
        if needs_reference and self.lora_cfg is None:
            self.reference_module = copy.deepcopy(module).eval()
        torch.manual_seed(self.seed)  # identical adapter init on every rank
        if self.lora_cfg is not None:
            self._inject_lora(module)
        else:
            module.requires_grad_(True)
        if self._distributed:
            self._shard(module)
            if self.reference_module is not None:
                self._shard(self.reference_module)
        self.module = module
        self._build_optimizer()

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _check_block_classes(self, module: nn.Module) -> None:
        present = {type(m).__name__ for m in module.modules()}
        missing = [name for name in self.block_class_names if name not in present]
        if missing:
            import difflib

            hints = {n: difflib.get_close_matches(n, present, n=3) for n in missing}
            raise ValueError(
                f"FSDPBackend.block_class_names {missing} not found in {type(module).__name__}; "
                f"closest classes in the model: {hints}. Set backend.block_class_names to the model's block class."
            )

    def _inject_lora(self, module: nn.Module) -> None:
        inject_lora(module, self.lora_cfg)
        module.to(self.device)

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        cfg = self.fsdp_cfg
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[cfg.param_dtype], reduce_dtype=TORCH_DTYPES[cfg.reduce_dtype])
        world = dist.get_world_size()
        if cfg.fsdp_mode == "no_shard":  # HSDP with shard size 1 == replicate everything
            mesh = init_device_mesh(self.device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("shard",))
        kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        blocks = [m for m in module.modules() if type(m).__name__ in self.block_class_names]
        for block in blocks:
            if cfg.activation_checkpointing:
                from torch.distributed._composable import checkpoint

                checkpoint(block)
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)

    def _build_optimizer(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        cfg = self.optimizer_cfg
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_scheduler_cfg.factor)

    # --------------------------------------------------------------- training
    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        return (p for p in self.module.parameters() if p.requires_grad)

    def num_trainable_parameters(self) -> int:
        """Global count (sharded parameters counted once)."""
        return sum(p.numel() for p in self.trainable_parameters())

    @contextlib.contextmanager
    def reference(self) -> Iterator[nn.Module]:
        """The frozen reference policy: adapters disabled (LoRA) or the initial copy (full)."""
        if self.lora_cfg is not None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            layers = [m for m in self.module.modules() if isinstance(m, BaseTunerLayer)]
            for layer in layers:
                layer.enable_adapters(False)
            try:
                yield self.module
            finally:
                for layer in layers:
                    layer.enable_adapters(True)
        elif self.reference_module is not None:
            yield self.reference_module
        else:
            raise RuntimeError("no reference model was built: setup(needs_reference=True) is required")

    @contextlib.contextmanager
    def sampling(self) -> Iterator[nn.Module]:
        """Keep gathered parameters across the many no-grad forwards of sampling, then reshard.

        Decoding calls the model once per token; resharding after each call would all-gather the
        weights again every time. Every sharded module is resharded on exit (the root's reshard
        does not reach its blocks).
        """
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        for m in sharded:
            m.set_reshard_after_forward(False)
        try:
            yield self.module
        finally:
            for m in sharded:
                m.set_reshard_after_forward(self.fsdp_cfg.reshard_after_forward)
                m.reshard()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, max_grad_norm: float | None) -> dict[str, float]:
        """Clip, step, advance the schedule; returns ``grad_norm`` (pre-clip) and ``lr``."""
        params = list(self.trainable_parameters())
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_grad_norm or float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return {"grad_norm": float(norm), "lr": float(lr)}

    # ------------------------------------------------------------- checkpoint
    def _dcp_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(ignore_frozen_params=True)
        model = get_model_state_dict(self.module, options=options)
        model = {k: v for k, v in model.items() if k in self._trainable_names()}
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=options)
        return {"model": model, "optim": optim["state"]}

    def _trainable_names(self) -> set[str]:
        return {name for name, p in self.module.named_parameters() if p.requires_grad}

    def save(self, directory: str) -> dict[str, Any]:
        """Collective: write this rank's DCP shards; returns small JSON-able backend state."""
        os.makedirs(directory, exist_ok=True)
        dcp_io.save(self._dcp_state(), directory)
        return {"optimizer_steps": self.optimizer_steps, "scheduler_last_epoch": self.scheduler.last_epoch}

    def load(self, directory: str, meta: dict[str, Any]) -> None:
        """Collective: restore model + optimizer shards (any world size) and the schedule."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self._init_optimizer_state()
        state = self._dcp_state()
        dcp_io.load(state, directory)
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        set_model_state_dict(self.module, state["model"], options=options)
        full = get_optimizer_state_dict(self.module, self.optimizer, options=options)
        full["state"] = state["optim"]
        set_optimizer_state_dict(self.module, self.optimizer, full, options=options)
        self.optimizer_steps = int(meta["optimizer_steps"])
        self.scheduler.last_epoch = int(meta["scheduler_last_epoch"])
        for group, base_lr in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base_lr * self.lr_scheduler_cfg.factor(self.scheduler.last_epoch)

    def _init_optimizer_state(self) -> None:
        """Materialise AdamW's lazily created state (zeros) so DCP has tensors to load into."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p in self.optimizer.state and self.optimizer.state[p]:
                    continue
                self.optimizer.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    def full_trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full (unsharded) trainable weights on rank 0, CPU; ``{}`` elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(self.module, options=options)
        names = self._trainable_names()
        return {k: v for k, v in state.items() if k in names}
