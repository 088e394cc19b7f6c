"""EMA shadows of the trainable weights.

Two kinds, both updated as ``shadow = decay * shadow + (1 - decay) * live`` on each rank's local
shard (no communication: a shadow is laid out exactly like its live tensor):

- ``AdapterEma`` (the NFT injection, ``EmaLoraConfig``): a frozen LoRA adapter next to the trainable
  one on the same modules. It is a real adapter, so the "old" policy is sampled by switching the
  active adapter (``shadow_active``), without touching weights.
- ``MirrorEma`` (``EmaFullConfig``): one shadow tensor per trainable parameter, cloned from the
  parameter *after* the FSDP2 wrap, i.e. from its DTensor shard. Registering the shadows as module
  parameters before the wrap (the other way to get the same layout) would make FSDP2 all-gather
  them in every forward: twice the communication and the unsharded memory, for tensors that
  forward never reads. The plan (which parameters, and the shadow names) is fixed before the wrap.

Swapping the EMA weights in for evaluation exchanges values in place, tensor by tensor, so the
swap back is exact and the extra memory is one tensor, not one model.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Iterator

import torch
from torch import nn

from unirl_ray.train.backend.lora import activate_adapter, adapter_parameters, inject_lora
from unirl_ray.train.backend.wrap import local
from unirl_ray.train.configs import EmaFullConfig, EmaLoraConfig

Pair = tuple[torch.Tensor, torch.Tensor]  # (live, shadow)


@torch.no_grad()
def ema_update_(pairs: list[Pair], decay: float) -> None:
    """``shadow = decay * shadow + (1 - decay) * live`` for every pair (decay 0: exact copy)."""
    for live, shadow in pairs:
        src, dst = local(live), local(shadow)
        if decay == 0.0:
            dst.copy_(src)
        else:
            dst.mul_(decay).add_(src.to(dst.dtype), alpha=1.0 - decay)


@torch.no_grad()
def exchange_(pairs: list[Pair]) -> None:
    """Swap the values of each pair in place (bit-exact; twice restores the original)."""
    for a, b in pairs:
        la, lb = local(a), local(b)
        held = la.clone()
        la.copy_(lb)
        lb.copy_(held)


class _Ema(abc.ABC):
    """What both EMAs share: ``pairs()`` of (live, shadow) tensors, the decay schedule of ``cfg`` and
    the count of updates applied."""

    cfg: EmaLoraConfig | EmaFullConfig
    updates: int

    @abc.abstractmethod
    def pairs(self) -> list[Pair]:
        """(live, shadow) tensor pairs, in a fixed order."""

    def update(self) -> float:
        """One EMA step ``shadow = d * shadow + (1 - d) * live``; returns the decay ``d`` used."""
        decay = self.cfg.decay(self.updates)
        ema_update_(self.pairs(), decay)
        self.updates += 1
        return decay

    def reset_to_live(self) -> None:
        """Restart the EMA from the live weights (a checkpoint without this shadow was loaded)."""
        ema_update_(self.pairs(), 0.0)


class AdapterEma(_Ema):
    """The NFT adapter pair on ``module``: ``cfg.default_adapter`` trains, ``cfg.shadow_adapter`` is its EMA."""

    def __init__(self, module: nn.Module, cfg: EmaLoraConfig) -> None:
        self.module = module
        self.cfg = cfg
        self.updates = 0
        """EMA updates applied so far (the index of the next one)."""

    @classmethod
    def inject(cls, module: nn.Module, cfg: EmaLoraConfig) -> "AdapterEma":
        """Before the wrap: add both adapters, start the shadow as an exact copy, train only the default."""
        lora = cfg.lora()
        inject_lora(module, lora, adapter_name=cfg.shadow_adapter)
        inject_lora(module, lora, adapter_name=cfg.default_adapter)  # last: leaves only `default` trainable
        ema = cls(module, cfg)
        ema_update_(ema.pairs(), 0.0)
        activate_adapter(module, cfg.default_adapter)
        return ema

    def pairs(self) -> list[Pair]:
        """(trainable, shadow) adapter weights; re-read each time (the wrap replaces parameters)."""
        live = adapter_parameters(self.module, self.cfg.default_adapter)
        shadow = adapter_parameters(self.module, self.cfg.shadow_adapter)
        assert len(live) == len(shadow) and all(a.shape == b.shape for a, b in zip(live, shadow))
        return list(zip(live, shadow))

    def shadow_names(self) -> set[str]:
        ids = {id(p) for p in adapter_parameters(self.module, self.cfg.shadow_adapter)}
        return {name for name, p in self.module.named_parameters() if id(p) in ids}


    @contextlib.contextmanager
    def shadow_active(self) -> Iterator[nn.Module]:
        """Forward passes use the shadow adapter inside; the default one again after."""
        activate_adapter(self.module, self.cfg.shadow_adapter)
        try:
            yield self.module
        finally:
            activate_adapter(self.module, self.cfg.default_adapter)


class MirrorEma(_Ema):
    """Shadow tensors of the trainable parameters of ``module`` (``EmaFullConfig``)."""

    def __init__(self, cfg: EmaFullConfig, names: list[str]) -> None:
        self.cfg = cfg
        self.names = names
        self.module: nn.Module | None = None
        self.shadow: dict[str, torch.Tensor] = {}
        """Shadow name -> tensor laid out like its parameter (a DTensor shard under FSDP2)."""
        self.updates = 0
        """EMA updates applied so far (the index of the next one)."""

    @classmethod
    def plan(cls, module: nn.Module, cfg: EmaFullConfig) -> "MirrorEma":
        """Before the wrap: which parameters get a shadow (the trainable ones) and its name."""
        names = [name for name, p in module.named_parameters() if p.requires_grad]
        taken = set(module.state_dict().keys())
        clashes = [cls.shadow_name(cfg, n) for n in names if cls.shadow_name(cfg, n) in taken]
        if clashes:
            raise ValueError(
                f"EmaFullConfig.shadow_prefix={cfg.shadow_prefix!r} makes shadow names that the model already "
                f"uses ({clashes[:3]}); pick another prefix"
            )
        return cls(cfg, names)

    @staticmethod
    def shadow_name(cfg: EmaFullConfig, name: str) -> str:
        head, _, leaf = name.rpartition(".")
        return f"{head}.{cfg.shadow_prefix}{leaf}" if head else f"{cfg.shadow_prefix}{leaf}"

    def materialize(self, module: nn.Module) -> None:
        """After the wrap: clone each (sharded) parameter, so the shadow starts equal to it."""
        params = dict(module.named_parameters())
        self.module = module
        with torch.no_grad():
            self.shadow = {self.shadow_name(self.cfg, n): params[n].detach().clone() for n in self.names}

    def pairs(self) -> list[Pair]:
        params = dict(self.module.named_parameters())
        return [(params[n], self.shadow[self.shadow_name(self.cfg, n)]) for n in self.names]

