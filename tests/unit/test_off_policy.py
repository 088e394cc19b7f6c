"""Off-policy correction (decoupled PPO with truncated / masked importance weights) in GRPO and
Flow-GRPO, and the TrainStack's proximal log-prob pass."""

import math

import pytest
import torch

from unirl_ray.algorithms import GRPO, FlowGRPO
from unirl_ray.algorithms.off_policy import OffPolicyCorrection

from test_flow_grpo import FakePipeline as FlowPipeline
from test_flow_grpo import Shift, ctx_for
from test_flow_grpo import make_samples as flow_samples
from test_grpo import FakePipeline, Policy, ctx, make_samples, padded_cur


def test_weights_truncate_mask_and_no_cap():
    prox, behav = torch.tensor([0.0, 0.0, 0.0]), torch.tensor([0.0, -math.log(1.5), -math.log(4.0)])
    used, raw, capped = OffPolicyCorrection(mode="decoupled", is_cap=2.0).weights(prox, behav)
    assert raw.tolist() == pytest.approx([1.0, 1.5, 4.0]) and used.tolist() == pytest.approx([1.0, 1.5, 2.0])
    assert capped.tolist() == [False, False, True]
    used, _, _ = OffPolicyCorrection(mode="decoupled", is_cap=2.0, cap_policy="mask").weights(prox, behav)
    assert used.tolist() == pytest.approx([1.0, 1.5, 0.0])
    used, _, capped = OffPolicyCorrection(mode="decoupled", is_cap=None).weights(prox, behav)
    assert used.tolist() == pytest.approx([1.0, 1.5, 4.0]) and not capped.any()


def test_recipe_forms_and_errors():
    assert OffPolicyCorrection.of(None).mode == "none"
    assert OffPolicyCorrection.of("decoupled").decoupled
    assert OffPolicyCorrection.of({"mode": "decoupled", "is_cap": 3.0}).is_cap == 3.0
    with pytest.raises(ValueError, match="mode"):
        OffPolicyCorrection.of({"mode": "vtrace"})
    with pytest.raises(ValueError, match="unknown keys"):
        OffPolicyCorrection.of({"mode": "decoupled", "cap": 2})
    with pytest.raises(ValueError, match="is_cap"):
        OffPolicyCorrection(mode="decoupled", is_cap=0.5)
    with pytest.raises(ValueError, match="cap_policy"):
        GRPO(group_size=2, off_policy={"mode": "decoupled", "cap_policy": "drop"})
    assert GRPO(group_size=2, off_policy="decoupled").needs_proximal and not GRPO(group_size=2).needs_proximal


def grpo_pair(lengths, behav, prox_value, adv, **off):
    """(samples, segment) with behaviour log-probs ``behav`` and proximal ``prox_value`` everywhere."""
    samples = make_samples(lengths, adv, old=behav)
    algo = GRPO(group_size=2, clip_low=0.2, clip_high=0.2, off_policy={"mode": "decoupled", **off},
                pipeline=FakePipeline(padded_cur(lengths, prox_value)))
    segment = algo.prepare_segment(samples, seed=0)
    segment["proximal_log_probs"] = algo.proximal_log_probs(samples, segment, Policy())
    return algo, samples, segment


def test_grpo_decoupled_hand_computed():
    """Tokens drawn by an older policy: ratio against pi_prox, each token weighted by pi_prox / pi_behav."""
    lengths = [2, 2]
    behav = torch.tensor([[0.0, math.log(4.0)], [0.0, 0.0]])  # sample 0 token 1: behaviour 4x likelier than prox
    algo, samples, segment = grpo_pair(lengths, behav, 0.0, [1.0, -1.0], is_cap=2.0)
    assert segment["proximal_log_probs"]["s0-0"].tolist() == [0.0, 0.0]  # current policy (delta 0)
    policy = Policy(delta=math.log(1.1))  # the policy moved: ratio vs prox = 1.1 everywhere
    m = algo.compute_loss_and_backward(samples, segment, ctx(policy))
    # weights: sample 0: [1, 0.25], sample 1: [1, 1]; surrogate per token: A=1 -> -1.1 (inside the clip),
    # A=-1 -> max(1.1, 1.1) = 1.1; seq_mean_token_mean: s0 = (-1.1 - 0.275) / 2, s1 = 1.1
    assert m["policy_loss"] == pytest.approx((-1.1 - 0.275) / 2 + 1.1, rel=1e-5)
    assert m["is_weight"] == pytest.approx(1 + 0.25 + 1 + 1) and m["is_weight_max"] == pytest.approx(1.0)
    assert m["is_capped_frac"] == 0.0 and m["behav_kl"] == pytest.approx(0.5 * math.log(4.0) ** 2, rel=1e-5)
    assert m["ratio"] == pytest.approx(4 * 1.1, rel=1e-5)  # against pi_prox, not pi_behav
    # behaviour much less likely than prox: the weight 8 is truncated at the cap 2
    behav = torch.tensor([[0.0, -math.log(8.0)], [0.0, 0.0]])
    algo, samples, segment = grpo_pair(lengths, behav, 0.0, [1.0, -1.0], is_cap=2.0)
    m = algo.compute_loss_and_backward(samples, segment, ctx(Policy()))
    assert m["policy_loss"] == pytest.approx((-1 - 2) / 2 + 1, rel=1e-5)
    assert m["is_weight_max"] == pytest.approx(8.0) and m["is_capped_frac"] == 1.0
    algo, samples, segment = grpo_pair(lengths, behav, 0.0, [1.0, -1.0], is_cap=2.0, cap_policy="mask")
    m = algo.compute_loss_and_backward(samples, segment, ctx(Policy()))
    assert m["policy_loss"] == pytest.approx((-1 + 0) / 2 + 1, rel=1e-5)


def test_grpo_decoupled_equals_plain_when_on_policy():
    """With no staleness (pi_prox == pi_behav) the decoupled loss and its gradient are the plain ones."""
    lengths = [3, 2, 4]
    behav = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    cur = padded_cur(lengths, behav)
    grads = []
    for off in (None, "decoupled"):
        samples = make_samples(lengths, [1.0, -0.5, 0.3], old=behav)
        algo = GRPO(group_size=3, off_policy=off, pipeline=FakePipeline(cur))
        segment = algo.prepare_segment(samples, seed=0)
        if algo.needs_proximal:
            segment["proximal_log_probs"] = algo.proximal_log_probs(samples, segment, Policy())
        policy = Policy(delta=0.05)
        m = algo.compute_loss_and_backward(samples, segment, ctx(policy))
        grads.append((m["loss"], policy.delta.grad.item()))
    assert grads[0] == pytest.approx(grads[1], rel=1e-6)


def test_flow_grpo_decoupled_weights_each_step():
    # one trained step; behaviour log-probs 0, proximal log(2) for sample 0 and 0 for sample 1
    pipe = FlowPipeline(torch.tensor([[math.log(2.0)], [0.0]]), torch.ones(2))
    algo = FlowGRPO(group_size=2, clip_range=0.2, off_policy={"mode": "decoupled", "is_cap": 1.5}, pipeline=pipe)
    samples = flow_samples(1, [1.0, -1.0])
    segment = algo.prepare_segment(samples, seed=0)
    segment["proximal_log_probs"] = algo.proximal_log_probs(samples, segment, Shift())
    policy = Shift(math.log(1.1))
    m = algo.compute_loss_and_backward(samples, segment, ctx_for(policy))
    # ratios vs prox 1.1 (inside the clip); weights min(2, 1.5) = 1.5 and 1
    assert m["policy_loss"] == pytest.approx(-1.1 * 1.5 + 1.1, rel=1e-5)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_capped_frac"] == 1.0
    assert m["logp_gap"] == pytest.approx(abs(math.log(2.2)) + math.log(1.1), rel=1e-5)  # vs behaviour


def test_stack_computes_proximal_once_before_updates_and_reduces_max():
    from unirl_ray.core.sample import Sample, TextPart
    from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, CausalLMPipeline
    from unirl_ray.train.backend.fsdp import FSDPBackend
    from unirl_ray.train.configs import OptimizerConfig, TrainTopology
    from unirl_ray.train.stack import TrainStack

    bundle = CausalLMBundle.from_config(CausalLMConfig())
    pipe = CausalLMPipeline(bundle, max_new_tokens=6)
    backend = FSDPBackend(bundle=bundle, trainable_attr="model", block_class_names=["Qwen2DecoderLayer"],
                          optimizer_cfg=OptimizerConfig(learning_rate=1e-2))
    backend.setup(topology=TrainTopology(), device=torch.device("cpu"))
    algo = GRPO(group_size=4, off_policy={"mode": "decoupled", "is_cap": 2.0}, pipeline=pipe)
    stack = TrainStack(micro_batch_size=2, mini_batch_size=4, num_updates_per_batch=2, fsdp_backend=backend,
                       algorithm=algo)
    outputs = pipe.sample(["p"] * 8, list(range(8)))
    samples = []
    for i, (part, _) in enumerate(outputs):
        stale = TextPart(**{**part.__dict__, "log_probs": part.log_probs - 0.3 * (i % 2)})  # an older policy drew odd ones
        s = Sample(sample_id=f"s0-{i}", group_id=f"g{i // 4}", prompt="p", parts=[stale])
        s.reward = float(i % 4)
        samples.append(s)
    algo.compute_advantages(samples)
    calls = []
    original = algo.proximal_log_probs
    algo.proximal_log_probs = lambda *a, **k: calls.append(len(a[0])) or original(*a, **k)
    metrics = stack.train(samples, seed=0).metrics
    assert calls == [2, 2, 2, 2]  # every micro-batch once, before the 4 optimizer steps
    assert metrics["train/optimizer_steps"] == 4 and "timing/proximal_log_probs" in metrics
    assert metrics["algo/is_weight_max"] == pytest.approx(math.exp(0.3), rel=1e-3)  # the stale odd samples
    assert 1.0 < metrics["algo/is_weight"] < math.exp(0.3) and metrics["algo/is_capped_frac"] == 0.0
    odd = sum(len(s.parts[0].completion_ids) for s in samples[1::2]) / sum(len(s.parts[0].completion_ids) for s in samples)
    assert metrics["algo/behav_kl"] == pytest.approx(0.5 * 0.09 * odd, rel=1e-3)  # per token
