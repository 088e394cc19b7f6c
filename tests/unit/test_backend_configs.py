"""Config schemas of the backend: validation messages, the EMA decay formulas, and which
combinations FSDPBackend accepts."""

import logging

import pytest
import torch
from torch import nn

from _dist import Bundle, make_backend
from unirl_ray.train.backend.fsdp import FSDPBackend
from unirl_ray.train.configs import EmaFullConfig, EmaLoraConfig, FSDPConfig, LoraConfig, TrainTopology


def test_fsdp_modes_and_mesh_shapes():
    assert FSDPConfig().mesh_shape(4) == (4,)
    assert FSDPConfig(fsdp_mode="no_shard").mesh_shape(4) == (4, 1)
    assert FSDPConfig(fsdp_mode="hybrid", hsdp_shard_size=2).mesh_shape(8) == (4, 2)
    with pytest.raises(ValueError, match="hsdp_shard_size=3 does not divide the world size 8"):
        FSDPConfig(fsdp_mode="hybrid", hsdp_shard_size=3).mesh_shape(8)
    with pytest.raises(ValueError, match="needs hsdp_shard_size >= 1"):
        FSDPConfig(fsdp_mode="hybrid")
    with pytest.raises(ValueError, match="only applies to fsdp_mode='hybrid'"):
        FSDPConfig(hsdp_shard_size=2)
    with pytest.raises(ValueError, match="'full', 'hybrid' or 'no_shard'"):
        FSDPConfig(fsdp_mode="zero3")


def test_ema_lora_ramp_and_constant_decay():
    ramp = EmaLoraConfig(ema_flat_steps=2, ema_uprate=0.1, ema_uphold=0.25)
    # min(0.1 * max(0, i - 2), 0.25)
    assert [ramp.decay(i) for i in range(6)] == pytest.approx([0.0, 0.0, 0.0, 0.1, 0.2, 0.25])
    assert EmaLoraConfig(ema_decay_type="constant", ema_decay=0.3).decay(7) == 0.3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(shadow_adapter="default"), "give the shadow adapter its own name"),
        (dict(default_adapter="a.b"), "without dots"),
        (dict(ema_decay_type="constant", ema_decay=1.5), "ema_decay must be in"),
        (dict(ema_uphold=-0.1), "ema_uphold must be in"),
        (dict(ema_uprate=-1.0), "ema_uprate"),
        (dict(ema_flat_steps=-1), "ema_flat_steps"),
        (dict(timing="epoch"), "timing must be one of"),
        (dict(ema_decay_type="cosine"), "'constant' or 'ramp'"),
        (dict(target_modules=[]), "target_modules is empty"),
        (dict(rank=0), "rank must be >= 1"),
    ],
)
def test_ema_lora_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EmaLoraConfig(**kwargs)


def test_ema_lora_warns_about_fields_its_decay_type_ignores():
    with pytest.warns(UserWarning, match=r"\['ema_uprate'\] are ignored with ema_decay_type='constant'"):
        EmaLoraConfig(ema_decay_type="constant", ema_uprate=0.5)
    with pytest.warns(UserWarning, match=r"\['ema_decay'\] are ignored"):
        EmaLoraConfig(ema_decay=0.2)


def test_ema_full_decay_warmup():
    cfg = EmaFullConfig(target_decay=0.95)
    assert cfg.decay(0) == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    assert cfg.decay(90) == pytest.approx(0.91)  # 91 / 100
    assert cfg.decay(10_000) == 0.95
    assert EmaFullConfig(target_decay=0.95, decay_warmup=False).decay(0) == 0.95
    with pytest.raises(ValueError, match="shadow_prefix"):
        EmaFullConfig(shadow_prefix="ema.")
    with pytest.raises(ValueError, match="target_decay"):
        EmaFullConfig(target_decay=2.0)


def test_backend_rejects_lora_with_ema_lora_and_untyped_configs():
    with pytest.raises(ValueError, match="EmaLoraConfig already injects the LoRA adapters"):
        FSDPBackend(block_class_names=["Block"], trainable_attr="net", lora_cfg=LoraConfig(), ema_lora_cfg=EmaLoraConfig())
    with pytest.raises(ValueError, match=r"_target_: unirl_ray.train.configs.EmaFullConfig"):
        FSDPBackend(block_class_names=["Block"], trainable_attr="net", ema_full_cfg={"target_decay": 0.9})


def test_shadow_prefix_clash_is_rejected():
    bundle = Bundle()
    bundle.net.head.register_parameter("shadow_weight", nn.Parameter(torch.zeros(3)))  # == head.weight's shadow name
    backend = FSDPBackend(block_class_names=["Block"], trainable_attr="net", bundle=bundle, ema_full_cfg=EmaFullConfig())
    with pytest.raises(ValueError, match=r"shadow names that the model already uses \(\['head.shadow_weight'\]\)"):
        backend.setup(topology=TrainTopology(), device=torch.device("cpu"))


def test_cpu_offload_without_process_group_warns(caplog):
    with caplog.at_level(logging.WARNING):
        make_backend(fsdp_cfg=FSDPConfig(cpu_offload=True))
    assert "cpu_offload is ignored" in caplog.text
