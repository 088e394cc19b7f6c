"""Group-relative advantages: hand-computed values, invalid rewards, degenerate groups, metrics."""

import math

import pytest

from unirl_ray.algorithms import group_advantages


def test_one_group_normalized_hand_computed():
    adv, m = group_advantages([1.0, 2.0, 3.0, 4.0], ["g"] * 4, eps=0.0)
    # mean 2.5, population std sqrt(1.25) = 1.1180340
    expected = [-1.3416408, -0.4472136, 0.4472136, 1.3416408]
    assert adv == pytest.approx(expected, abs=1e-6)
    assert m["algo/adv_mean"] == pytest.approx(0.0, abs=1e-12)
    assert m["algo/adv_std"] == pytest.approx(1.0, abs=1e-6)
    assert m["algo/adv_abs_max"] == pytest.approx(1.3416408, abs=1e-6)
    assert m["algo/zero_std_group_frac"] == 0.0
    assert m["algo/invalid_reward_frac"] == 0.0


def test_eps_is_added_to_std():
    adv, _ = group_advantages([1.0, 2.0, 3.0, 4.0], ["g"] * 4)
    assert adv[3] == pytest.approx(1.5 / (math.sqrt(1.25) + 1e-4), rel=1e-9)


def test_without_std_normalization():
    adv, _ = group_advantages([1.0, 2.0, 3.0, 4.0], ["g"] * 4, normalize_std=False)
    assert adv == pytest.approx([-1.5, -0.5, 0.5, 1.5])


def test_groups_are_independent_and_interleaved():
    adv, _ = group_advantages([0.0, 10.0, 1.0, 20.0], ["a", "b", "a", "b"], normalize_std=False)
    assert adv == pytest.approx([-0.5, -5.0, 0.5, 5.0])


def test_invalid_and_degenerate_groups():
    rewards = [1.0, None, 3.0, float("nan"), 5.0, 5.0, 7.0]
    groups = ["a", "a", "a", "a", "b", "b", "c"]
    adv, m = group_advantages(rewards, groups, eps=0.0)
    # group a: valid [1, 3] -> mean 2, std 1; b: equal rewards; c: a single member
    assert adv == pytest.approx([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert m["algo/zero_std_group_frac"] == pytest.approx(2 / 3)
    assert m["algo/invalid_reward_frac"] == pytest.approx(2 / 7)
    assert m["algo/adv_abs_max"] == pytest.approx(1.0)
    assert all(math.isfinite(a) for a in adv)


def test_group_with_one_valid_member_gets_zero():
    adv, m = group_advantages([1.0, float("inf"), None], ["g", "g", "g"])
    assert adv == [0.0, 0.0, 0.0]
    assert m["algo/zero_std_group_frac"] == 1.0


def test_empty_and_length_mismatch():
    adv, m = group_advantages([], [])
    assert adv == [] and m["algo/adv_mean"] == 0.0
    with pytest.raises(ValueError, match="group id"):
        group_advantages([1.0, 2.0], ["g"])


def test_rewards_near_the_float_limit_do_not_overflow_the_statistics():
    # 1e308 passed as a valid reward; the group sums overflowed and every advantage (and loss) was NaN
    from unirl_ray.algorithms.diffusion_nft import DiffusionNFT
    from unirl_ray.algorithms.grpo import rloo_advantages
    from unirl_ray.core.sample import Sample

    huge = [1e308, -1e308, 1e308, 0.0, 1.7e308, 1.7e308, -1.7e308, 1e-300]
    groups = ["a"] * 4 + ["b"] * 4
    adv, metrics = group_advantages(huge, groups)
    unit, _ = group_advantages([1.0, -1.0, 1.0, 0.0, 1.0, 1.0, -1.0, 0.0], groups)  # the same shape, scaled
    assert adv == pytest.approx(unit, rel=1e-3)  # the same up to eps (1e-4 against a std of ~1 there, ~0 here)
    assert all(math.isfinite(v) for v in metrics.values())
    assert all(math.isfinite(a) for a in rloo_advantages(huge, groups, normalize_std=True))
    with pytest.raises(ValueError, match=r"advantages overflow: rewards reach 1.7e\+308.*normalize_std"):
        group_advantages(huge, groups, normalize_std=False)  # r - mean itself is out of float range
    with pytest.raises(ValueError, match=r"RLOO advantages overflow"):
        rloo_advantages(huge, groups)
    samples = [Sample(sample_id=f"s{i}", group_id=g, prompt="p", reward=r) for i, (g, r) in enumerate(zip(groups, huge))]
    nft_metrics = DiffusionNFT(group_size=4, global_std=True).compute_advantages(samples)
    assert all(math.isfinite(s.advantage) for s in samples) and all(math.isfinite(v) for v in nft_metrics.values())
