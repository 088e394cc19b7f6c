"""Group-relative advantages (GRPO): each reward is compared with the other samples of its prompt."""

from __future__ import annotations

import math
from collections import defaultdict


def _is_valid(r: float | None) -> bool:
    return r is not None and math.isfinite(r)


def scaled_group_stats(values: list[float]) -> tuple[float, list[float], float, float]:
    """``(s, u, mean_u, std_u)`` with ``u = v / s`` for ``s = max |v|``: a group's statistics computed on
    values in [-1, 1], so rewards near the float limit (1e308) cannot overflow the sums (population std)."""
    scale = max(abs(v) for v in values) or 1.0
    u = [v / scale for v in values]
    mean = math.fsum(u) / len(u)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in u) / len(u))
    return scale, u, mean, std


def check_finite_advantages(adv: list[float], rewards: list[float | None], what: str) -> None:
    """ValueError when an advantage overflowed (unnormalised advantages of rewards near the float limit)."""
    if all(math.isfinite(a) for a in adv):
        return
    largest = max((abs(r) for r in rewards if _is_valid(r)), default=float("nan"))
    raise ValueError(
        f"{what} advantages overflow: rewards reach {largest:.3g}, and without std normalisation r - mean is "
        "not a finite float. Scale the reward down (its weight in reward.rewards) or set normalize_std=true"
    )


def group_advantages(
    rewards: list[float | None],
    group_ids: list[str],
    *,
    normalize_std: bool = True,
    eps: float = 1e-4,
) -> tuple[list[float], dict[str, float]]:
    """Advantage ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g``) per sample, over its group ``g``.

    Only valid rewards (not ``None``, finite) enter a group's statistics; ``std_g`` is the population
    standard deviation (ddof = 0), computed without overflow for any finite rewards (a ValueError if
    the unnormalised advantage itself is out of float range). Invalid samples get 0.0. A group with fewer than 2 valid members,
    or whose valid rewards are all equal, gets 0.0 for every member (no learning signal).

    Metrics (over all samples unless said otherwise):
    ``algo/adv_mean``, ``algo/adv_std`` (population), ``algo/adv_abs_max``;
    ``algo/zero_std_group_frac``: fraction of groups with no signal (all valid rewards equal, or < 2 valid);
    ``algo/invalid_reward_frac``: fraction of samples whose reward is invalid.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"got {len(rewards)} rewards but {len(group_ids)} group ids; pass one group id per reward")
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        members[g].append(i)
    adv = [0.0] * len(rewards)
    zero_groups = 0
    for idx in members.values():
        valid = [i for i in idx if _is_valid(rewards[i])]
        values = [float(rewards[i]) for i in valid]  # type: ignore[arg-type]
        if len(values) < 2 or max(values) == min(values):
            zero_groups += 1
            continue
        # (v - mean) / (std + eps) == (u - mean_u) / (std_u + eps / s): finite for any finite rewards
        s, u, mean, std = scaled_group_stats(values)
        for i, x in zip(valid, u):
            adv[i] = (x - mean) / (std + eps / s) if normalize_std else (x - mean) * s
    check_finite_advantages(adv, rewards, "group-relative")
    return adv, _metrics(adv, rewards, zero_groups, len(members))


def _metrics(adv: list[float], rewards: list[float | None], zero_groups: int, n_groups: int) -> dict[str, float]:
    n = len(adv)
    if n == 0:
        keys = ("adv_mean", "adv_std", "adv_abs_max", "zero_std_group_frac", "invalid_reward_frac")
        return {f"algo/{k}": 0.0 for k in keys}
    mean = math.fsum(adv) / n
    return {
        "algo/adv_mean": mean,
        "algo/adv_std": math.sqrt(math.fsum((a - mean) ** 2 for a in adv) / n),
        "algo/adv_abs_max": max(abs(a) for a in adv),
        "algo/zero_std_group_frac": zero_groups / n_groups,
        "algo/invalid_reward_frac": sum(not _is_valid(r) for r in rewards) / n,
    }
