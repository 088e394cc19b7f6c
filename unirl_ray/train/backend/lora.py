"""LoRA injection (peft) shared by the train backend and rollout engines, so both hold the same
structure and a LoRA-only weight sync lines up name for name."""

from __future__ import annotations

from torch import nn

from unirl_ray.train.configs import LoraConfig


def inject_lora(module: nn.Module, cfg: LoraConfig) -> int:
    """Add adapters in place; only adapter weights stay trainable. Returns their parameter count."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        init_lora_weights=cfg.init_lora_weights,
    )
    inject_adapter_in_model(peft_cfg, module)
    trainable = 0
    for name, param in module.named_parameters():
        is_lora = "lora_" in name
        param.requires_grad_(is_lora)
        trainable += param.numel() if is_lora else 0
    if trainable == 0:
        raise ValueError(f"LoraConfig.target_modules={cfg.target_modules} matched no module of the model")
    return trainable
