"""Config schemas of the train side (the seed's names).

Every schema is a small kw_only dataclass, validated on construction so that a bad recipe fails on
the driver before any worker starts.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Literal

from unirl_ray.config.checks import check_literal_fields
from unirl_ray.core.dtypes import TORCH_DTYPES

_DTYPES = tuple(TORCH_DTYPES)


@dataclass(kw_only=True)
class FSDPConfig:
    """How the trainable module is sharded (FSDP2 ``fully_shard``)."""

    fsdp_mode: Literal["full", "hybrid", "no_shard"] = "full"
    """``full``: shard parameters over all ranks; ``hybrid`` (HSDP): shard within groups of
    ``hsdp_shard_size`` ranks and replicate across the groups; ``no_shard``: replicate (DDP-like)."""
    hsdp_shard_size: int | None = None
    """Ranks per shard group in ``hybrid`` mode; must divide the world size (only for ``hybrid``)."""
    param_dtype: str = "float32"
    """Compute dtype of parameters in forward/backward (mixed precision when not float32)."""
    reduce_dtype: str = "float32"
    """Dtype of gradient reduction."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each forward (less memory, more communication)."""
    activation_checkpointing: bool = False
    """Recompute block activations in backward to save memory."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (FSDP2
    ``CPUOffloadPolicy``): the optimizer steps on CPU, parameters are copied to the device per use."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        if self.fsdp_mode == "hybrid":
            if self.hsdp_shard_size is None or int(self.hsdp_shard_size) < 1:
                raise ValueError(
                    "FSDPConfig.fsdp_mode='hybrid' needs hsdp_shard_size >= 1 (ranks per shard group, "
                    f"e.g. the GPUs of one node), got {self.hsdp_shard_size!r}"
                )
        elif self.hsdp_shard_size is not None:
            raise ValueError(
                f"FSDPConfig.hsdp_shard_size={self.hsdp_shard_size} only applies to fsdp_mode='hybrid' "
                f"(got fsdp_mode={self.fsdp_mode!r}); remove it or set fsdp_mode: hybrid"
            )
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"FSDPConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")

    def mesh_shape(self, world_size: int) -> tuple[int, ...]:
        """Device-mesh shape for ``world_size`` ranks: ``(shard,)`` or ``(replicate, shard)``."""
        if self.fsdp_mode == "full":
            return (world_size,)
        if self.fsdp_mode == "no_shard":  # HSDP with shard groups of one == replicate everything
            return (world_size, 1)
        shard = int(self.hsdp_shard_size)
        if world_size % shard:
            raise ValueError(
                f"FSDPConfig.hsdp_shard_size={shard} does not divide the world size {world_size}: "
                "every shard group must have the same number of ranks; pick a divisor of the world size"
            )
        return (world_size // shard, shard)


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


EmaTiming = Literal["rollout_end", "optimizer_step"]
"""When an EMA shadow is updated: once per train step (``rollout_end``) or after every optimizer step."""


def _check_adapter_name(owner: str, field_name: str, value: str) -> None:
    if not value or "." in value:
        raise ValueError(f"{owner}.{field_name} must be a non-empty name without dots, got {value!r}")


@dataclass(kw_only=True)
class EmaLoraConfig:
    """The NFT injection (DiffusionNFT): two LoRA adapters on the same modules, a trainable
    ``default_adapter`` and a frozen ``shadow_adapter`` that holds the EMA of the trainable one.

    The shadow is the "old" policy used for sampling (``FSDPBackend.shadow_policy()``). An EMA
    update is ``shadow = decay * shadow + (1 - decay) * default`` (so decay 0 copies the trainable
    adapter); ``decay(i)`` gives the decay of the i-th update (0-based count of updates applied so far).
    Replaces ``LoraConfig``: do not set both.
    """

    rank: int = 8
    """Adapter rank r (both adapters)."""
    alpha: float = 16.0
    """Scaling numerator (scale = alpha / rank)."""
    dropout: float = 0.0
    """Adapter dropout. Keep 0 for RL: non-zero breaks the exact pi_old == pi ratio at step start."""
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module name patterns (peft semantics) that get both adapters."""
    init_lora_weights: str | bool = True
    """peft init scheme of the trainable adapter; the shadow starts as an exact copy of it."""
    default_adapter: str = "default"
    """Name of the trainable adapter (the one weight sync and export see)."""
    shadow_adapter: str = "old"
    """Name of the frozen EMA adapter."""
    ema_decay_type: Literal["constant", "ramp"] = "ramp"
    """``constant``: decay(i) = ema_decay; ``ramp``: decay(i) = min(ema_uprate * max(0, i - ema_flat_steps), ema_uphold)."""
    ema_decay: float = 0.9
    """Decay of every update when ema_decay_type is ``constant`` (in [0, 1])."""
    ema_flat_steps: int = 0
    """``ramp``: updates with index <= this use decay 0 (the shadow copies the trainable adapter)."""
    ema_uprate: float = 0.001
    """``ramp``: decay added per update after the flat phase."""
    ema_uphold: float = 0.5
    """``ramp``: ceiling of the decay (in [0, 1])."""
    timing: EmaTiming = "rollout_end"
    """When the shadow is updated: once per train step (end of ``TrainStack.train``) or after every optimizer step."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        if self.rank < 1:
            raise ValueError(f"EmaLoraConfig.rank must be >= 1, got {self.rank}")
        if not (0.0 <= self.dropout < 1.0):
            raise ValueError(f"EmaLoraConfig.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("EmaLoraConfig.target_modules is empty: name the modules that get adapters")
        _check_adapter_name("EmaLoraConfig", "default_adapter", self.default_adapter)
        _check_adapter_name("EmaLoraConfig", "shadow_adapter", self.shadow_adapter)
        if self.default_adapter == self.shadow_adapter:
            raise ValueError(
                f"EmaLoraConfig.default_adapter and shadow_adapter are both {self.default_adapter!r}: "
                "give the shadow adapter its own name (e.g. 'old')"
            )
        for name in ("ema_decay", "ema_uphold"):
            if not (0.0 <= getattr(self, name) <= 1.0):
                raise ValueError(f"EmaLoraConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.ema_uprate < 0 or not math.isfinite(self.ema_uprate):
            raise ValueError(f"EmaLoraConfig.ema_uprate must be a finite number >= 0, got {self.ema_uprate}")
        if self.ema_flat_steps < 0:
            raise ValueError(f"EmaLoraConfig.ema_flat_steps must be >= 0, got {self.ema_flat_steps}")
        defaults = {f.name: f.default for f in fields(self)}
        unused = ("ema_flat_steps", "ema_uprate", "ema_uphold") if self.ema_decay_type == "constant" else ("ema_decay",)
        changed = [n for n in unused if getattr(self, n) != defaults[n]]
        if changed:
            warnings.warn(
                f"EmaLoraConfig: {changed} are ignored with ema_decay_type={self.ema_decay_type!r}", stacklevel=2
            )

    def decay(self, update_index: int) -> float:
        """Decay of the EMA update number ``update_index`` (0-based)."""
        if self.ema_decay_type == "constant":
            return float(self.ema_decay)
        return float(min(self.ema_uprate * max(0, update_index - self.ema_flat_steps), self.ema_uphold))

    def lora(self) -> LoraConfig:
        """The adapter shape as a ``LoraConfig`` (what each of the two adapters is injected with)."""
        return LoraConfig(
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            target_modules=list(self.target_modules),
            init_lora_weights=self.init_lora_weights,
        )


@dataclass(kw_only=True)
class EmaFullConfig:
    """Mirror EMA: a shadow copy of every trainable parameter (adapter weights only with LoRA),
    sharded exactly like its parameter, for evaluation and export (``FSDPBackend.ema_weights()``).

    An update is ``shadow = decay * shadow + (1 - decay) * param``; ``decay(i)`` gives the decay of
    the i-th update (0-based).
    """

    target_decay: float = 0.9999
    """Decay once warmed up (in [0, 1])."""
    decay_warmup: bool = True
    """Use decay(i) = min(target_decay, (1 + i) / (10 + i)) so early updates track the fast-moving weights."""
    timing: EmaTiming = "optimizer_step"
    """When the shadow is updated: after every optimizer step, or once per train step."""
    shadow_prefix: str = "shadow_"
    """Prefix of the shadow's leaf name: parameter ``a.b.weight`` has shadow ``a.b.shadow_weight`` in checkpoints."""

    def __post_init__(self) -> None:
        check_literal_fields(self)
        if not (0.0 <= self.target_decay <= 1.0):
            raise ValueError(f"EmaFullConfig.target_decay must be in [0, 1], got {self.target_decay}")
        _check_adapter_name("EmaFullConfig", "shadow_prefix", self.shadow_prefix)

    def decay(self, update_index: int) -> float:
        """Decay of the EMA update number ``update_index`` (0-based)."""
        if self.decay_warmup:
            return float(min(self.target_decay, (1 + update_index) / (10 + update_index)))
        return float(self.target_decay)


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
    fused: bool = True
    """torch's fused AdamW kernel (CPU and CUDA): one kernel for all parameters instead of a chain of
    per-op calls, which on FSDP2's DTensor shards each go through DTensor dispatch (2 ranks, tiny LM on
    CPU: 1.3 ms instead of 9 ms per step). False: the default multi-tensor (``foreach``) loop."""

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
        check_literal_fields(self)
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


BACKEND_CONFIG_TYPES: dict[str, type] = {
    "fsdp_cfg": FSDPConfig,
    "optimizer_cfg": OptimizerConfig,
    "lr_scheduler_cfg": LrSchedulerConfig,
    "lora_cfg": LoraConfig,
    "ema_lora_cfg": EmaLoraConfig,
    "ema_full_cfg": EmaFullConfig,
}
"""The config objects a backend takes, by argument name."""


def check_backend_config(name: str, value: object, where: str = "FSDPBackend") -> None:
    """``ValueError`` unless ``value`` (the backend argument ``name``) is None or a config of its type: a mapping
    without ``_target_`` (e.g. an override written ``{kind:constant}``, which YAML reads as keys, not pairs) is
    refused here, naming the ``_target_`` to write."""
    cls = BACKEND_CONFIG_TYPES[name]
    if value is not None and not isinstance(value, cls):
        raise ValueError(f"{where}.{name} must be a {cls.__name__} (in a recipe: _target_: {cls.__module__}."
                         f"{cls.__name__}), got {type(value).__name__}")


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
