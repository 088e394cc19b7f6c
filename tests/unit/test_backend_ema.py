"""EMA injections in one process: the NFT adapter pair (EmaLoraConfig), the mirror EMA
(EmaFullConfig), their update timings, the shadow-policy and eval-EMA switches."""

import pytest
import torch

from _dist import DIM, make_backend, train
from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.core.sample import Sample
from unirl_ray.train.configs import EmaFullConfig, EmaLoraConfig, LoraConfig
from unirl_ray.train.stack import TrainStack

X = torch.randn(6, DIM, generator=torch.Generator().manual_seed(3))


def nft_cfg(**kw):
    base = dict(rank=2, alpha=2, target_modules=["to_q"], init_lora_weights="gaussian")
    return EmaLoraConfig(**{**base, **kw})


def snapshot(backend):
    return {n: p.detach().clone() for n, p in backend.module.named_parameters()}


def flags(backend):
    return {n: p.requires_grad for n, p in backend.module.named_parameters()}


class Regress(StageAlgorithm):
    """Fake algorithm: loss = mean((policy(x) - 1)^2) over the samples' x."""

    supports_multi_update = True

    def compute_advantages(self, samples):
        return {}

    def compute_loss_and_backward(self, samples, segment, ctx: LossContext):
        x = torch.stack([torch.tensor(s.columns["x"]) for s in samples])
        loss = (ctx.policy(x) - 1).pow(2).mean()
        (loss * ctx.loss_scale).backward()
        return {"loss": loss.item() * len(samples), "count": len(samples)}


def samples(n):
    g = torch.Generator().manual_seed(1)
    return [Sample(sample_id=f"s{i}", group_id="g", prompt="p", columns={"x": torch.randn(DIM, generator=g).tolist()})
            for i in range(n)]


def test_nft_injection_trains_only_the_default_adapter_and_starts_the_shadow_equal():
    backend = make_backend(ema_lora_cfg=nft_cfg())
    trainable = sorted(n for n, f in flags(backend).items() if f)
    assert trainable == [f"blocks.{i}.to_q.lora_{ab}.default.weight" for i in (0, 1) for ab in "AB"]
    for live, shadow in backend.adapter_ema.pairs():
        assert torch.equal(live, shadow) and not shadow.requires_grad
    assert backend.adapter_ema.shadow_names() == {
        f"blocks.{i}.to_q.lora_{ab}.old.weight" for i in (0, 1) for ab in "AB"}


def test_nft_rollout_end_update_runs_once_per_train_step_with_the_documented_formula():
    backend = make_backend(ema_lora_cfg=nft_cfg(ema_decay_type="constant", ema_decay=0.25))
    stack = TrainStack(fsdp_backend=backend, algorithm=Regress(), micro_batch_size=2, mini_batch_size=2)
    shadow_before = [s.detach().clone() for _, s in backend.adapter_ema.pairs()]
    result = stack.train(samples(4), seed=0)
    assert result.num_optimizer_steps == 2 and backend.adapter_ema.updates == 1
    assert result.metrics["train/ema_lora_decay"] == 0.25
    for (live, shadow), old in zip(backend.adapter_ema.pairs(), shadow_before):
        assert not torch.equal(live, old)  # the adapter trained
        assert torch.allclose(shadow, 0.25 * old + 0.75 * live, rtol=0, atol=1e-7)


def test_mirror_ema_per_optimizer_step_follows_the_warmup_formula():
    backend = make_backend(ema_full_cfg=EmaFullConfig(target_decay=0.5))
    expected = snapshot(backend)
    for step in range(3):
        train(backend, 1, start=step)
        decay = min(0.5, (1 + step) / (10 + step))
        expected = {n: decay * expected[n] + (1 - decay) * p.detach() for n, p in backend.module.named_parameters()}
    assert backend.mirror_ema.updates == 3
    for name, value in expected.items():
        head, _, leaf = name.rpartition(".")
        torch.testing.assert_close(backend.mirror_ema.shadow[f"{head}.shadow_{leaf}"], value, rtol=0, atol=1e-6)


def test_shadow_policy_samples_with_the_old_adapter_and_leaves_training_untouched():
    backend = make_backend(ema_lora_cfg=nft_cfg(ema_decay_type="constant", ema_decay=0.5), needs_reference=True)
    train(backend, 2)
    backend.update_ema(timing="rollout_end")
    before_flags = flags(backend)
    with torch.no_grad():
        live = backend.module(X)
        with backend.shadow_policy() as module:
            old = module(X)
            assert flags(backend) == before_flags  # peft's set_adapter would have frozen `default`
        with backend.ema_weights() as module:  # the shadow's values put in the trainable adapter
            assert torch.equal(module(X), old)
        assert torch.equal(backend.module(X), live)
        with backend.reference() as ref:
            base = ref(X)
    assert not torch.allclose(old, live) and not torch.allclose(base, live)
    assert flags(backend) == before_flags
    train(backend, 1, start=2)  # still trains after the switches


def test_ema_weights_swaps_back_bit_identically_and_exports_the_ema():
    backend = make_backend(ema_full_cfg=EmaFullConfig(target_decay=0.9, decay_warmup=False))
    train(backend, 3)
    live = snapshot(backend)
    shadow = {k: v.clone() for k, v in backend.mirror_ema.shadow.items()}
    with backend.ema_weights() as module:
        exported = backend.full_trainable_state_dict()
        for name, p in module.named_parameters():
            head, _, leaf = name.rpartition(".")
            assert torch.equal(p, shadow[f"{head}.shadow_{leaf}"])
            assert torch.equal(exported[name], p)
            assert not torch.equal(p, live[name])
        with pytest.raises(RuntimeError, match="inside ema_weights"):
            backend.optimizer_step(1.0)  # training on the EMA weights would corrupt both
    after = snapshot(backend)
    assert all(torch.equal(after[n], live[n]) for n in live)
    assert all(torch.equal(backend.mirror_ema.shadow[k], v) for k, v in shadow.items())


def test_lora_with_mirror_ema_shadows_only_the_adapter():
    backend = make_backend(lora_cfg=LoraConfig(rank=2, alpha=2, target_modules=["to_q"]), ema_full_cfg=EmaFullConfig())
    expected = {f"blocks.{i}.to_q.lora_{ab}.default.shadow_weight" for i in (0, 1) for ab in "AB"}
    assert set(backend.mirror_ema.shadow) == expected
    train(backend, 2)
    assert backend.mirror_ema.updates == 2


def test_nft_with_mirror_ema_evaluates_with_the_mirror():
    backend = make_backend(ema_lora_cfg=nft_cfg(), ema_full_cfg=EmaFullConfig(target_decay=0.3, decay_warmup=False))
    train(backend, 2)
    mirror = backend.mirror_ema.shadow["blocks.0.to_q.lora_A.default.shadow_weight"].clone()
    nft_shadow = backend.module.blocks[0].to_q.lora_A["old"].weight.detach().clone()
    assert not torch.equal(mirror, nft_shadow)
    with backend.ema_weights() as module:
        assert torch.equal(module.blocks[0].to_q.lora_A["default"].weight, mirror)


def test_switches_without_their_injection_are_refused():
    backend = make_backend()
    with pytest.raises(ValueError, match="set backend.ema_lora_cfg"):
        with backend.shadow_policy():
            pass
    with pytest.raises(ValueError, match="set backend.ema_full_cfg"):
        with backend.ema_weights():
            pass
    with pytest.raises(ValueError, match="'rollout_end' or 'optimizer_step'"):
        backend.update_ema(timing="epoch")
    assert backend.update_ema(timing="rollout_end") == {}
