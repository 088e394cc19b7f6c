"""Multi-turn rows: a trajectory's turns chained into one sequence train exactly as the turns would one by one.

Each turn's context is the exact ids of everything before it (token in, token out), so under a causal model
the chained row's logits at a turn's tokens are those of that turn alone: with each turn counted as a
sequence the gradient of one chained row equals the gradient of its turns as separate rows, for every
per-sequence aggregation and with per-turn advantages.
"""

import pytest
import torch

from unirl_ray.algorithms import GRPO, DrGRPO, LossContext
from unirl_ray.core.sample import Sample, TextPart, chain_turns
from unirl_ray.models.causal_lm import CausalLMBundle, CausalLMConfig, CausalLMPipeline


@pytest.fixture(scope="module")
def tiny():
    bundle = CausalLMBundle.from_config(CausalLMConfig())
    return bundle, CausalLMPipeline(bundle, max_prompt_tokens=96, max_new_tokens=6)


def trajectory(pipe, seed, observation=(10, 11, 12)):
    """Two turns: turn 0 from a chat prompt, an observation, turn 1 from everything before it."""
    context = pipe.encode_prompts(["hi"])[0]
    turn0, _ = pipe.sample_ids([context], [seed])[0]
    context1 = context + turn0.completion_ids.tolist() + list(observation)
    turn1, _ = pipe.sample_ids([context1], [seed + 1])[0]
    return [turn0, turn1]


def grads(model, algo, samples):
    model.zero_grad()
    segment = algo.prepare_segment(samples, seed=0)
    ctx = LossContext(policy=model, reference=None, loss_scale=1.0, first_pass=True,
                      global_units=algo.loss_units(samples))
    metrics = algo.compute_loss_and_backward(samples, segment, ctx)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, metrics


@pytest.mark.parametrize("cls", [GRPO, DrGRPO])
@pytest.mark.parametrize("per_turn", [False, True])
def test_chained_turns_train_like_separate_turns(tiny, cls, per_turn):
    bundle, pipe = tiny
    algo = cls(group_size=2, pipeline=pipe)
    chained, separate = [], []
    for i in range(2):
        turns = trajectory(pipe, seed=10 * i)
        advantages = [0.7, -1.3] if per_turn else [None, None]
        for t, a in zip(turns, advantages):
            t.advantage = a
        chained.append(Sample(sample_id=f"t{i}", group_id="g", prompt="hi", parts=turns, advantage=(-1.0) ** i))
        for k, t in enumerate(turns):
            separate.append(Sample(sample_id=f"t{i}-{k}", group_id="g", prompt="hi", parts=[t],
                                   advantage=t.advantage if per_turn else (-1.0) ** i))
    assert algo.loss_units(chained) == algo.loss_units(separate) == 4  # every turn is a sequence
    g_chain, m_chain = grads(bundle.model, algo, chained)
    g_sep, m_sep = grads(bundle.model, algo, separate)
    for name in g_chain:
        torch.testing.assert_close(g_chain[name], g_sep[name], rtol=1e-4, atol=1e-6, msg=name)
    assert m_chain["loss"] == pytest.approx(m_sep["loss"], rel=1e-4, abs=1e-6)
    assert m_chain["loss_count"] == m_sep["loss_count"] == 4
    assert m_chain["count"] == m_sep["count"]  # the observation tokens are not trained
    assert m_chain["logp_gap"] / m_chain["logp_gap_count"] < 1e-5  # the recorded log-probs are recomputed


def test_chain_masks_observations_and_refuses_an_edited_history(tiny):
    _, pipe = tiny
    turns = trajectory(pipe, seed=3, observation=(20, 21))
    sample = Sample(sample_id="t", group_id="g", prompt="hi", parts=turns)
    row = chain_turns(sample, turns)
    n0, n1 = len(turns[0].completion_ids), len(turns[1].completion_ids)
    assert row.prompt_ids.tolist() == turns[0].prompt_ids.tolist()
    assert (row.prompt_ids.tolist() + row.completion_ids.tolist()
            == turns[1].prompt_ids.tolist() + turns[1].completion_ids.tolist())  # the ids sampled, token for token
    assert row.loss_mask.tolist() == [1.0] * n0 + [0.0, 0.0] + [1.0] * n1
    assert row.segments.tolist() == [0] * n0 + [-1, -1] + [1] * n1
    assert row.log_probs[n0 : n0 + 2].tolist() == [0.0, 0.0]
    batch = pipe.collate([row])
    assert batch["segment_ids"][0].tolist().count(1) == n1 and batch["completion_mask"].sum() == n0 + n1

    edited = TextPart(prompt_ids=turns[1].prompt_ids.clone(), completion_ids=turns[1].completion_ids,
                      log_probs=turns[1].log_probs, loss_mask=turns[1].loss_mask)
    edited.prompt_ids[len(turns[0].prompt_ids)] += 1  # the first sampled token of turn 0, "re-tokenised"
    with pytest.raises(ValueError, match="does not continue the ids before it"):
        chain_turns(sample, [turns[0], edited])


def test_contexts_in_token_ids_are_never_truncated(tiny):
    _, pipe = tiny
    with pytest.raises(ValueError, match="never truncated"):
        pipe.sample_ids([[5] * 97], [0])
    part, _ = pipe.sample_ids([[5] * 96], [0])[0]
    assert len(part.prompt_ids) == 96  # the exact ids, no template, no cut
    same, _ = pipe.sample(["hi"], [4])[0]
    again, _ = pipe.sample_ids([pipe.encode_prompts(["hi"])[0]], [4])[0]
    assert torch.equal(same.completion_ids, again.completion_ids)  # text in and ids in agree
