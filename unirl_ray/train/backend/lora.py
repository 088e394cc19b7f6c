"""LoRA injection (peft) shared by the train backend and rollout engines, so both hold the same
structure and a LoRA-only weight sync lines up name for name."""

from __future__ import annotations

from torch import nn

from unirl_ray.train.configs import LoraConfig


def inject_lora(module: nn.Module, cfg: LoraConfig, *, adapter_name: str = "default") -> int:
    """Add adapter ``adapter_name`` in place; only its weights stay trainable (every other
    parameter, other adapters included, is frozen). Returns its parameter count."""
    import warnings

    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        init_lora_weights=cfg.init_lora_weights,
    )
    with warnings.catch_warnings():  # a second adapter is intended (the NFT pair)
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        inject_adapter_in_model(peft_cfg, module, adapter_name=adapter_name)
    params = adapter_parameters(module, adapter_name)
    trainable_ids = {id(p) for p in params}
    for param in module.parameters():
        param.requires_grad_(id(param) in trainable_ids)
    if not params:
        raise ValueError(f"LoraConfig.target_modules={cfg.target_modules} matched no module of the model")
    return sum(p.numel() for p in params)


def tuner_layers(module: nn.Module) -> list[nn.Module]:
    """The peft layers (modules that hold adapters) of ``module``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def adapter_parameters(module: nn.Module, adapter_name: str) -> list[nn.Parameter]:
    """Every parameter of adapter ``adapter_name``, in a fixed order (module order, then peft's
    bank order), so two adapters of the same shape line up element for element."""
    out: list[nn.Parameter] = []
    for layer in tuner_layers(module):
        for bank_name in layer.adapter_layer_names:
            bank = getattr(layer, bank_name, None)
            if bank is None or adapter_name not in bank:
                continue
            entry = bank[adapter_name]
            out.extend(entry.parameters() if isinstance(entry, nn.Module) else [entry])
    return out


def activate_adapter(module: nn.Module, adapter_name: str) -> None:
    """Make ``adapter_name`` the adapter every peft layer applies, leaving ``requires_grad`` alone.

    peft's ``set_adapter`` also marks the activated adapter trainable and every other one frozen;
    switching to the frozen shadow adapter for sampling must not change what trains, so the flags
    are put back before any forward can see them.
    """
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for layer in tuner_layers(module):
        layer.set_adapter(adapter_name)
    for param, flag in flags:
        if param.requires_grad != flag:
            param.requires_grad_(flag)
