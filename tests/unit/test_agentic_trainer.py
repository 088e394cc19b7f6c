"""The agentic trainer's driver stages without Ray: settling a step's rewards (failed trajectories, per-turn
rewards) and per-turn credit, hand-computed."""

import math
from types import SimpleNamespace

import pytest
import torch

from unirl_ray.algorithms import GRPO
from unirl_ray.core.sample import Sample, TextPart
from unirl_ray.trainer.agentic import AgenticTrainer, TurnCredit


def sample(i, group, reward, turns):
    parts = [TextPart(prompt_ids=torch.tensor([1]), completion_ids=torch.tensor([2]), log_probs=torch.zeros(1),
                      loss_mask=torch.ones(1)) for _ in range(turns)]
    return Sample(sample_id=f"s{i}", group_id=group, prompt="p", parts=parts, rewards={"exact": reward}, reward=reward)


def test_settle_voids_failed_trajectories_and_adds_turn_rewards():
    samples = [sample(0, "g", 1.0, 2), sample(1, "g", 1.0, 2), sample(2, "g", 0.0, 1)]
    trajectories = [SimpleNamespace(failure=None, turn_rewards=[0.5, None]),
                    SimpleNamespace(failure="tool 'python' crashed", turn_rewards=[None, None]),
                    SimpleNamespace(failure=None, turn_rewards=[None])]
    metrics = AgenticTrainer.settle(samples, trajectories)
    assert samples[0].reward == 1.5 and samples[0].rewards["environment"] == 0.5 and samples[0].parts[0].reward == 0.5
    assert samples[1].reward is None and samples[1].rewards == {"exact": None, "trajectory": None}
    assert samples[2].reward == 0.0 and metrics == {"agent/turn_rewarded_frac": pytest.approx(1 / 3)}


def test_turn_credit_is_each_turns_return_to_go_against_the_groups_baseline():
    a, b, c, d = sample(0, "g", 2.0, 2), sample(1, "g", 0.0, 1), sample(2, "g", None, 2), sample(3, "h", 1.0, 1)
    a.parts[0].reward = 0.5  # the environment rewarded a's first turn; a's answer earned 1.5
    credit = TurnCredit(GRPO(group_size=3))
    credit(1, [a, b, c, d])
    mean, std = 1.0, 1.0  # valid returns of group g: 2.0 and 0.0
    scale = std + 1e-4
    assert a.parts[0].advantage == pytest.approx((2.0 - mean) / scale)  # G_0 = 1.5 + 0.5
    assert a.parts[1].advantage == pytest.approx((1.5 - mean) / scale)  # G_1 = the answer only
    assert b.parts[0].advantage == pytest.approx((0.0 - mean) / scale)
    assert [p.advantage for p in c.parts] == [0.0, 0.0] and c.advantage == 0.0  # invalid: nothing to learn
    assert d.parts[0].advantage == 0.0  # a group of one has no baseline
    assert math.isclose(a.advantage, (2.0 - mean) / scale, rel_tol=1e-3)
