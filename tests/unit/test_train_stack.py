"""FSDPBackend + TrainStack in one process (no process group: the module is used unwrapped)."""

import os
import pickle

import pytest
import torch
from torch import nn

from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.core.sample import Sample
from unirl_ray.train.backend import dcp_io
from unirl_ray.train.backend.fsdp import FSDPBackend
from unirl_ray.train.configs import LoraConfig, LrSchedulerConfig, OptimizerConfig, TrainTopology
from unirl_ray.train.stack import TrainStack


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(4, 4)

    def forward(self, x):
        return self.to_q(x).tanh()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Bundle:
    def __init__(self):
        torch.manual_seed(0)
        self.net = Net()


class RegressToZero(StageAlgorithm):
    """Fake algorithm: loss = mean(policy(x)^2) * advantage, x from the sample's columns."""

    supports_multi_update = True

    def compute_advantages(self, samples):
        for s in samples:
            s.advantage = 1.0
        return {}

    def compute_loss_and_backward(self, samples, segment, ctx: LossContext):
        x = torch.stack([torch.tensor(s.columns["x"]) for s in samples])
        loss = ctx.policy(x).pow(2).mean()
        (loss * ctx.loss_scale).backward()
        return {"loss": loss.item() * len(samples), "count": len(samples)}


class SingleUpdate(RegressToZero):
    supports_multi_update = False


def make_samples(n):
    g = torch.Generator().manual_seed(1)
    return [Sample(sample_id=f"s{i}", group_id="g", prompt="p", columns={"x": torch.randn(4, generator=g).tolist()}) for i in range(n)]


def make_stack(**kw):
    backend = FSDPBackend(
        block_class_names=["Block"], trainable_attr="net", optimizer_cfg=OptimizerConfig(learning_rate=0.05),
        bundle=Bundle(), lora_cfg=kw.pop("lora_cfg", None), lr_scheduler_cfg=kw.pop("lr_scheduler_cfg", None),
    )
    algorithm = kw.pop("algorithm", RegressToZero())
    stack = TrainStack(fsdp_backend=backend, algorithm=algorithm, **kw)
    backend.setup(topology=TrainTopology(), device=torch.device("cpu"), needs_reference=True)
    return stack


def test_train_step_lowers_loss_and_counts_optimizer_steps():
    stack = make_stack(micro_batch_size=2, mini_batch_size=4, num_updates_per_batch=2)
    samples = make_samples(8)
    first = stack.train(samples, seed=0)
    assert first.num_optimizer_steps == 4  # 2 epochs x 2 mini-batches
    assert first.policy_version == 1
    for _ in range(5):
        last = stack.train(samples, seed=0)
    assert last.metrics["train/loss"] < first.metrics["train/loss"]
    assert last.metrics["train/grad_norm"] > 0
    m = last.metrics
    assert 0 < m["timing/forward_backward"] + m["timing/optimizer_step"] <= m["timing/train_step"]


class PoisonedAdvantage(RegressToZero):
    """The loss of an advantage that overflowed: NaN."""

    def compute_loss_and_backward(self, samples, segment, ctx: LossContext):
        part = super().compute_loss_and_backward(samples, segment, ctx)
        return {**part, "loss": float("nan")}


class InfiniteGradient(RegressToZero):
    def compute_loss_and_backward(self, samples, segment, ctx: LossContext):
        x = torch.stack([torch.tensor(s.columns["x"]) for s in samples])
        (ctx.policy(x).sum() * float("inf")).backward()
        return {"loss": 1.0, "count": len(samples)}


@pytest.mark.parametrize("algorithm, message", [
    (PoisonedAdvantage(), r"non-finite loss in mini-batch 1 of policy version 2 \(loss on this rank\)"),
    (InfiniteGradient(), r"the gradient norm is (nan|inf) before optimizer step 2"),
])
def test_a_non_finite_loss_or_gradient_stops_the_step_before_the_optimizer(algorithm, message):
    stack = make_stack(micro_batch_size=4)
    stack.train(make_samples(4), seed=0)  # a good step first
    good = {n: p.detach().clone() for n, p in stack.backend.module.named_parameters()}
    moments = [t.clone() for st in stack.backend.optimizer.state.values() for t in (st["exp_avg"], st["exp_avg_sq"])]
    stack.algorithm = algorithm
    with pytest.raises(FloatingPointError, match=message):
        stack.train(make_samples(4), seed=1)
    after = dict(stack.backend.module.named_parameters())
    assert all(torch.equal(after[n], good[n]) for n in good)  # the optimizer did not step: nothing NaN to save
    state = [t for st in stack.backend.optimizer.state.values() for t in (st["exp_avg"], st["exp_avg_sq"])]
    assert all(torch.equal(a, b) for a, b in zip(state, moments, strict=True))
    assert stack.policy_version == 1 and stack.backend.optimizer_steps == 1


def test_multi_update_refused_without_support():
    backend = FSDPBackend(block_class_names=["Block"], trainable_attr="net", bundle=Bundle())
    with pytest.raises(ValueError, match="does not support multiple updates"):
        TrainStack(fsdp_backend=backend, algorithm=SingleUpdate(), num_updates_per_batch=2)


def test_shard_size_must_split_into_mini_batches():
    stack = make_stack(micro_batch_size=2, mini_batch_size=4)
    with pytest.raises(ValueError, match="must split into mini-batches"):
        stack.train(make_samples(6), seed=0)


def test_unknown_block_class_names_closest():
    backend = FSDPBackend(block_class_names=["Blok"], trainable_attr="net", bundle=Bundle())
    with pytest.raises(ValueError, match="Block"):
        backend.setup(topology=TrainTopology(), device=torch.device("cpu"))


def test_lora_trains_only_adapters_and_reference_disables_them():
    stack = make_stack(lora_cfg=LoraConfig(rank=2, alpha=2, target_modules=["to_q"]), micro_batch_size=4)
    backend = stack.backend
    base_before = {n: p.detach().clone() for n, p in backend.module.named_parameters() if "lora_" not in n}
    x = torch.randn(3, 4)
    with torch.no_grad():
        out_before = backend.module(x)
    for _ in range(3):
        stack.train(make_samples(4), seed=0)
    for n, p in backend.module.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n
    with torch.no_grad():
        assert not torch.allclose(backend.module(x), out_before)
        with backend.reference() as ref:
            assert torch.allclose(ref(x), out_before)  # adapters off == the base model
        assert not torch.allclose(backend.module(x), out_before)  # and back on


def test_lr_schedule_warmup_then_cosine():
    cfg = LrSchedulerConfig(kind="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert cfg.factor(0) == pytest.approx(0.5)
    assert cfg.factor(1) == pytest.approx(1.0)
    assert cfg.factor(2) == pytest.approx(1.0)
    assert cfg.factor(6) == pytest.approx(0.1)
    assert cfg.factor(4) == pytest.approx(0.1 + 0.9 * 0.5)
    with pytest.raises(ValueError, match="total_steps"):
        LrSchedulerConfig(kind="linear")


def test_bad_optimizer_values_rejected():
    with pytest.raises(ValueError, match="learning_rate"):
        OptimizerConfig(learning_rate=-1.0)


def test_dcp_metadata_refuses_foreign_classes(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    os.makedirs(tmp_path / "ck")
    with open(tmp_path / "ck" / ".metadata", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(ValueError, match="not a DCP metadata type"):
        dcp_io.load({"x": torch.zeros(1)}, str(tmp_path / "ck"))


def test_dcp_roundtrip_single_process(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"m": torch.ones(2)}}
    dcp_io.save(state, str(tmp_path / "ck"))
    target = {"model": {"w": torch.zeros(2, 3)}, "optim": {"m": torch.zeros(2)}}
    dcp_io.load(target, str(tmp_path / "ck"))
    assert torch.equal(target["model"]["w"], state["model"]["w"])
    with pytest.raises(TypeError, match="only tensors"):
        dcp_io.save({"x": 3}, str(tmp_path / "bad"))


def test_mini_batch_counts_samples_over_all_ranks():
    stack = make_stack(micro_batch_size=4, mini_batch_size=32)
    assert stack.rank_mini_batch(32, 1) == 32  # one rank: one optimizer step over its 32 samples
    assert stack.rank_mini_batch(16, 2) == 16  # two ranks: still one step over the same 32 samples
    assert stack.rank_mini_batch(32, 2) == 16  # 64 samples: two steps of 32
    with pytest.raises(ValueError, match="over all ranks, so 10.6667 per rank"):
        stack.rank_mini_batch(16, 3)
    with pytest.raises(ValueError, match="per-rank micro-batches of 4"):
        make_stack(micro_batch_size=4, mini_batch_size=8).rank_mini_batch(16, 4)
    assert make_stack(micro_batch_size=4).rank_mini_batch(12, 3) == 12  # None: the whole batch
