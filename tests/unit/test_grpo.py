"""GRPO family: hand-computed advantages, aggregations, clipping, KL, entropy, global token normalisation."""

import math
from contextlib import nullcontext

import pytest
import torch

from unirl_ray.algorithms import DAPO, GRPO, RLOO, DrGRPO, LossContext
from unirl_ray.algorithms.grpo import kl_penalty, rloo_advantages
from unirl_ray.core.sample import Sample, TextPart
from unirl_ray.train.stack import TrainStack


class Policy(torch.nn.Module):
    """A 'policy' whose ``delta`` shifts every log-prob and whose ``h`` is every token's entropy."""

    def __init__(self, delta: float = 0.0, h: float = 1.0):
        super().__init__()
        self.delta = torch.nn.Parameter(torch.tensor(delta))
        self.h = torch.nn.Parameter(torch.tensor(h))


class FakePipeline:
    """logp[b, t] = cur[row_b, t] + delta (row_b = prompt_ids[0]); entropy = h everywhere."""

    max_new_tokens = 4

    def __init__(self, cur: torch.Tensor):
        self.cur = cur

    def collate(self, parts):
        T = self.cur.shape[1]
        mask = torch.zeros(len(parts), T)
        old = torch.zeros(len(parts), T)
        for b, p in enumerate(parts):
            mask[b, : len(p.loss_mask)] = p.loss_mask
            old[b, : len(p.log_probs)] = p.log_probs
        rows = torch.tensor([int(p.prompt_ids[0]) for p in parts])
        return {"rows": rows, "completion_mask": mask, "old_log_probs": old}

    def token_log_probs(self, module, batch):
        logp = self.cur[batch["rows"]] + module.delta
        return logp, module.h.expand_as(logp)


GARBAGE = 50.0  # log-prob values outside the completions: must never reach the loss


def make_samples(lengths, advantages, old=None, groups=None):
    out = []
    for i, (n, adv) in enumerate(zip(lengths, advantages)):
        part = TextPart(
            prompt_ids=torch.tensor([i]),
            completion_ids=torch.zeros(n, dtype=torch.long),
            log_probs=torch.zeros(n) if old is None else old[i][:n].clone(),
            loss_mask=torch.ones(n),
        )
        group = groups[i] if groups else "g"
        out.append(Sample(sample_id=f"s0-{i}", group_id=group, prompt="p", parts=[part], advantage=adv))
    return out


def padded_cur(lengths, value=0.0, T=4):
    cur = torch.full((len(lengths), T), GARBAGE)
    for i, n in enumerate(lengths):
        cur[i, :n] = value if not torch.is_tensor(value) else value[i, :n]
    return cur


def ctx(policy, *, first_pass=True, reference=None, loss_scale=1.0, global_units=1.0, world_size=1):
    ref = None if reference is None else (lambda: nullcontext(reference))
    return LossContext(
        policy=policy,
        reference=ref,
        loss_scale=loss_scale,
        first_pass=first_pass,
        global_units=global_units,
        world_size=world_size,
    )


def run(algo, samples, policy, **kw):
    kw.setdefault("global_units", algo.loss_units(samples))  # what the stack passes: one rank, one micro-batch
    return algo.compute_loss_and_backward(samples, algo.prepare_segment(samples, seed=0), ctx(policy, **kw))


# ----------------------------------------------------------------------------------------------- advantages


def reward_samples():
    rewards = [1.0, 2.0, 3.0, 6.0, 0.5, 0.5, None, 1.0, 3.0]
    groups = ["a"] * 4 + ["b"] * 2 + ["c"] * 3
    samples = [Sample(sample_id=f"s{i}", group_id=g, prompt="p") for i, g in enumerate(groups)]
    for s, r in zip(samples, rewards):
        s.reward = r
    return samples


def test_grpo_advantages_hand_computed():
    samples = reward_samples()
    metrics = GRPO(group_size=4).compute_advantages(samples)
    std_a = math.sqrt((4 + 1 + 0 + 9) / 4)
    expected = [(r - 3) / (std_a + 1e-4) for r in (1, 2, 3, 6)] + [0, 0] + [0, -1 / (1 + 1e-4), 1 / (1 + 1e-4)]
    assert [s.advantage for s in samples] == pytest.approx(expected)
    assert metrics["algo/invalid_reward_frac"] == pytest.approx(1 / 9)
    assert metrics["algo/zero_std_group_frac"] == pytest.approx(1 / 3)
    assert "algo/filtered_group_frac" not in metrics


def test_no_std_and_rloo_advantages_hand_computed():
    samples = reward_samples()
    DrGRPO(group_size=4).compute_advantages(samples)
    assert [s.advantage for s in samples] == pytest.approx([-2, -1, 0, 3, 0, 0, 0, -1, 1])

    samples = reward_samples()
    RLOO(group_size=4).compute_advantages(samples)
    # r_i - mean of the others: 1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2; group c over its 2 valid rewards
    assert [s.advantage for s in samples] == pytest.approx([-8 / 3, -4 / 3, 0, 4, 0, 0, 0, -2, 2])
    std = rloo_advantages([1.0, 3.0], ["g", "g"], normalize_std=True)
    assert std == pytest.approx([-2 / (1 + 1e-4), 2 / (1 + 1e-4)])


def test_dynamic_sampling_marks_uninformative_groups():
    samples = reward_samples()
    samples[8].reward = 1.0  # group c: valid rewards now all equal
    algo = DAPO(group_size=4)
    metrics = algo.compute_advantages(samples)
    assert metrics["algo/filtered_group_frac"] == pytest.approx(2 / 3)
    assert all(s.advantage == 0 for s in samples[4:])
    assert [s.sample_id for s in algo.filter_uninformative(samples)] == ["s0", "s1", "s2", "s3"]


def test_presets_and_option_errors():
    dapo, dr, rloo = DAPO(group_size=2), DrGRPO(group_size=2), RLOO(group_size=2)
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_aggregation, dapo.dynamic_sampling) == (0.2, 0.28, "token_mean", True)
    assert (dr.normalize_std, dr.loss_aggregation) == (False, "seq_mean_token_sum_norm")
    assert (rloo.advantage_estimator, rloo.normalize_std) == ("rloo", False)
    assert GRPO.supports_multi_update and DAPO(group_size=2, clip_high=0.3).clip_high == 0.3
    with pytest.raises(ValueError, match="group_size"):
        GRPO(group_size=1)
    with pytest.raises(ValueError, match="loss_aggregation"):
        GRPO(group_size=2, loss_aggregation="sum")
    with pytest.raises(ValueError, match="advantage_estimator"):
        GRPO(group_size=2, advantage_estimator="ppo")
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPO(group_size=2, kl_estimator="k4")


# ----------------------------------------------------------------------------------------------- loss aggregation

LENGTHS, ADVS = [2, 4], [1.0, -2.0]  # ratio 1: per-token policy loss is -A = -1 (2 tokens), +2 (4 tokens)


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("seq_mean_token_mean", (-1 + 2) / 2),  # per-sequence means -1, 2
        ("token_mean", (-1 * 2 + 2 * 4) / 6),  # every token weighs the same
        ("seq_mean_token_sum_norm", (-2 / 4 + 8 / 4) / 2),  # sums / max_new_tokens (4)
    ],
)
def test_aggregation_loss_values(aggregation, expected):
    algo = GRPO(group_size=2, loss_aggregation=aggregation, pipeline=FakePipeline(padded_cur(LENGTHS)))
    samples = make_samples(LENGTHS, ADVS)
    policy = Policy()
    units = algo.loss_units(samples)
    assert units == (6 if aggregation == "token_mean" else 2)
    m = run(algo, samples, policy, global_units=units)
    assert m["loss"] / m["loss_count"] == pytest.approx(expected)
    assert m["policy_loss"] / m["policy_loss_count"] == pytest.approx(expected)
    assert m["count"] == 6 and m["ratio"] / m["count"] == pytest.approx(1.0)
    # d/d delta of -A exp(delta) at 0 is -A: the gradient equals the loss value
    assert policy.delta.grad.item() == pytest.approx(expected)
    reduced = TrainStack()._reduce(m, {}, 1)
    assert reduced["train/loss"] == pytest.approx(expected) and reduced["rollout/logp_gap"] == pytest.approx(0.0)


def test_dr_grpo_explicit_norm_constant():
    algo = DrGRPO(group_size=2, loss_norm_tokens=8, pipeline=FakePipeline(padded_cur(LENGTHS)))
    m = run(algo, make_samples(LENGTHS, ADVS), Policy())
    assert m["loss"] / m["loss_count"] == pytest.approx((-2 / 8 + 8 / 8) / 2)


def test_global_token_normalisation():
    """token_mean: the micro-batch token sum x world_size / global_units, whatever loss_scale says."""
    algo = DAPO(group_size=2, pipeline=FakePipeline(padded_cur(LENGTHS)))
    samples = make_samples(LENGTHS, ADVS)
    token_sum = -1 * 2 + 2 * 4

    policy = Policy()
    run(algo, samples, policy, global_units=12.0, world_size=2, loss_scale=0.5)  # other rank holds 6 more tokens
    assert policy.delta.grad.item() == pytest.approx(token_sum * 2 / 12)

    # two micro-batches of one sample each add up to the whole mini-batch's token mean
    split = Policy()
    for s in samples:
        run(algo, [s], split, global_units=6.0, loss_scale=0.5)
    assert split.delta.grad.item() == pytest.approx(token_sum / 6)

    # per-sequence aggregation: the sum of sequence means x world_size / the mini-batch's sequences (all ranks)
    seq = GRPO(group_size=2, pipeline=FakePipeline(padded_cur(LENGTHS)))
    policy = Policy()
    run(seq, samples, policy, loss_scale=0.5, global_units=4.0, world_size=2)  # the other rank holds 2 more
    assert policy.delta.grad.item() == pytest.approx((-1 + 2) * 2 / 4)
    split = Policy()
    for s in samples:  # micro-batches of one sequence each add up to the same mean
        run(seq, [s], split, loss_scale=0.5, global_units=2.0)
    assert split.delta.grad.item() == pytest.approx((-1 + 2) / 2)


# ----------------------------------------------------------------------------------------------- clipping


def test_asymmetric_clip():
    # sample 0: A = +1, ratio 1.25: inside DAPO's [0.8, 1.28] (loss -1.25, grad), clipped at 1.2 by GRPO (no grad)
    # sample 1: A = -1, ratio 0.75: clipped to 0.8 by both (loss max(0.75, 0.8) = 0.8, no grad)
    cur = padded_cur([1, 1], torch.tensor([[math.log(1.25)], [math.log(0.75)]]))
    samples = make_samples([1, 1], [1.0, -1.0])
    for cls, pg0, grad in ((GRPO, -1.2, 0.0), (DAPO, -1.25, -1.25)):
        algo = cls(group_size=2, loss_aggregation="seq_mean_token_mean", pipeline=FakePipeline(cur))
        policy = Policy()
        m = run(algo, samples, policy)
        assert m["policy_loss"] == pytest.approx(pg0 + 0.8)
        assert policy.delta.grad.item() == pytest.approx(grad / 2)
        assert m["clip_frac"] == (2 if cls is GRPO else 1)
        assert m["approx_kl"] == pytest.approx(0.5 * (math.log(1.25) ** 2 + math.log(0.75) ** 2))


def test_logp_gap_only_on_first_pass_and_old_log_probs_frozen():
    cur = padded_cur([3], torch.tensor([[0.1, -0.2, 0.3]]))
    algo = GRPO(group_size=2, pipeline=FakePipeline(cur))
    samples = make_samples([3], [1.0])
    segment = algo.prepare_segment(samples, seed=0)
    samples[0].parts[0].log_probs += 10.0  # pi_old stays what prepare_segment froze
    m = algo.compute_loss_and_backward(samples, segment, ctx(Policy()))
    assert m["logp_gap"] == pytest.approx(0.6) and m["logp_gap_count"] == 3
    m = algo.compute_loss_and_backward(samples, segment, ctx(Policy(), first_pass=False))
    assert m["logp_gap"] == 0 and m["logp_gap_count"] == 0
    with pytest.raises(ValueError, match="compute_advantages"):
        algo.compute_loss_and_backward(make_samples([3], [None]), segment, ctx(Policy()))


# ----------------------------------------------------------------------------------------------- KL / entropy


def test_kl_estimators_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_r = math.log(0.5)  # ref - logp
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-log_r)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - log_r)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_in_loss(estimator):
    cur = padded_cur([2], math.log(0.5))
    algo = GRPO(group_size=2, kl_beta=0.1, kl_estimator=estimator, pipeline=FakePipeline(cur))
    assert algo.needs_reference
    samples = make_samples([2], [0.0], old=cur)
    reference = Policy(delta=math.log(0.5))  # ref log-prob log(0.25)
    m = run(algo, samples, Policy(), reference=reference)
    k = kl_penalty(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25)), estimator).item()
    assert m["kl"] / m["count"] == pytest.approx(k)
    assert m["loss"] / m["loss_count"] == pytest.approx(0.1 * k)  # A = 0: only the KL term
    with pytest.raises(ValueError, match="reference"):
        run(algo, samples, Policy())


def test_entropy_bonus_raises_entropy():
    algo = GRPO(group_size=2, entropy_coef=0.01, pipeline=FakePipeline(padded_cur([2])))
    policy = Policy(h=2.0)
    m = run(algo, make_samples([2], [0.0]), policy)
    assert m["entropy"] / m["count"] == pytest.approx(2.0)
    assert m["loss"] / m["loss_count"] == pytest.approx(-0.01 * 2.0)
    assert policy.h.grad.item() == pytest.approx(-0.01)  # gradient descent increases the entropy


# ----------------------------------------------------------------------------------------------- real tiny model


def test_dapo_on_tiny_causal_lm_is_on_policy_and_steps_uphill():
    from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, CausalLMPipeline

    bundle = CausalLMBundle.from_config(CausalLMConfig())
    pipe = CausalLMPipeline(bundle, max_new_tokens=8)
    prompts = ["p"] * 4 + ["q"] * 4
    outputs = pipe.sample(prompts, list(range(8)))
    samples = []
    for i, (prompt, (part, text)) in enumerate(zip(prompts, outputs)):
        s = Sample(sample_id=f"s0-{i}", group_id=prompt, prompt=prompt, parts=[part])
        s.reward = float(i % 4)  # distinct rewards within each group
        samples.append(s)
    algo = DAPO(group_size=4, pipeline=pipe)
    algo.compute_advantages(samples)
    segment = algo.prepare_segment(samples, seed=0)
    m = algo.compute_loss_and_backward(
        samples, segment, ctx(bundle.model, global_units=algo.loss_units(samples))
    )
    assert m["logp_gap"] / m["logp_gap_count"] < 1e-5
    assert m["ratio"] / m["count"] == pytest.approx(1.0, abs=1e-5) and m["clip_frac"] == 0
    params = [p for p in bundle.model.parameters() if p.grad is not None]
    norm = torch.sqrt(sum((p.grad**2).sum() for p in params))
    with torch.no_grad():
        for p in params:
            p -= 0.01 * p.grad / norm  # a small descent step on the token-mean surrogate
    batch = pipe.collate([s.parts[0] for s in samples])
    with torch.no_grad():
        new, _ = pipe.token_log_probs(bundle.model, batch)
    adv = torch.tensor([s.advantage for s in samples])[:, None]
    gain = (adv * (new - batch["old_log_probs"]) * batch["completion_mask"]).sum()
    assert gain > 0  # probability moved towards the tokens of better-than-average completions
