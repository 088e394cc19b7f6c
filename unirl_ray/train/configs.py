"""Config schemas of the train side (the seed's names).

Every schema is a small kw_only dataclass, validated on construction so that a bad recipe fails on
the driver before any worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from unirl_ray.core.dtypes import TORCH_DTYPES

_DTYPES = tuple(TORCH_DTYPES)


@dataclass(kw_only=True)
class FSDPConfig:
    """How the trainable module is sharded (FSDP2 ``fully_shard``)."""

    fsdp_mode: Literal["full", "no_shard"] = "full"
    """``full``: shard parameters over all ranks; ``no_shard``: replicate (plain DDP-like)."""
    param_dtype: str = "float32"
    """Compute dtype of parameters in forward/backward (mixed precision when not float32)."""
    reduce_dtype: str = "float32"
    """Dtype of gradient reduction."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each forward (less memory, more communication)."""
    activation_checkpointing: bool = False
    """Recompute block activations in backward to save memory."""

    def __post_init__(self) -> None:
        if self.fsdp_mode not in ("full", "no_shard"):
            raise ValueError(f"FSDPConfig.fsdp_mode must be 'full' or 'no_shard', got {self.fsdp_mode!r}")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"FSDPConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters injected (peft) before the FSDP2 wrap; only adapter weights train."""

    rank: int = 8
    """Adapter rank r."""
    alpha: float = 16.0
    """Scaling numerator (scale = alpha / rank)."""
    dropout: float = 0.0
    """Adapter dropout. Keep 0 for RL: non-zero breaks the exact pi_old == pi ratio at step start."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module name patterns (peft semantics) that get adapters."""
    init_lora_weights: str | bool = True
    """peft init scheme (True = B zero so the adapted model starts equal to the base)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraConfig.rank must be >= 1, got {self.rank}")
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoraConfig.target_modules is empty: name the modules that get adapters")


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW over the trainable parameters."""

    learning_rate: float = 1e-4
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (not applied to biases and norms)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""

    def __post_init__(self) -> None:
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"OptimizerConfig.learning_rate must be a positive number, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        self.betas = tuple(float(b) for b in self.betas)  # YAML gives lists
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas must be two numbers in [0, 1), got {self.betas}")


@dataclass(kw_only=True)
class LrSchedulerConfig:
    """Learning-rate schedule over optimizer steps."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warmup."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the peak over this many optimizer steps."""
    total_steps: int | None = None
    """Optimizer steps the decay spans (required for linear/cosine)."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of the peak."""

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "linear", "cosine"):
            raise ValueError(f"LrSchedulerConfig.kind must be constant, linear or cosine, got {self.kind!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"LrSchedulerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.kind != "constant" and not self.total_steps:
            raise ValueError(f"LrSchedulerConfig.kind={self.kind!r} needs total_steps > 0")

    def factor(self, step: int) -> float:
        """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


@dataclass(kw_only=True, frozen=True)
class TrainTopology:
    """Rank layout the stack reads (data parallel today; TP/SP/EP plug in here later)."""

    world_size: int = 1
    """Number of train ranks."""
    rank: int = 0
    """This rank."""
    dp_size: int = 1
    """Data-parallel degree (== world_size until other parallelism exists)."""
    dp_rank: int = 0
    """This rank's data-parallel index."""

    @classmethod
    def from_env(cls) -> "TrainTopology":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        world, rank = dist.get_world_size(), dist.get_rank()
        return cls(world_size=world, rank=rank, dp_size=world, dp_rank=rank)
