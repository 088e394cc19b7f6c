"""Off-policy correction for stale samples (async trainers) and rollout / train mismatch.

A sample's log-probs were recorded by the *behaviour* policy (the rollout engine's weights at
version ``v``); with asynchronous rollout the trainer is at a later version when it trains on it.
``OffPolicyCorrection`` says how the PPO-style losses (``GRPO``, ``FlowGRPO``) treat that gap:

- ``mode: none``: the clipped surrogate's ``pi_old`` is the behaviour policy (``ratio = pi / pi_behav``);
  the clip is the only protection. Exactly the synchronous, on-policy loss.
- ``mode: decoupled`` (decoupled PPO, Hilton et al. 2021, as AReaL uses it for async RL): the
  stack recomputes the log-probs of the *proximal* policy (the trainer's weights at the start of the
  train step, no gradient) once per step; the surrogate clips ``ratio = pi / pi_prox`` around the
  proximal policy and each unit (token, or denoising step) is weighted by the importance weight
  ``w = pi_prox / pi_behav``, detached, which corrects for the behaviour policy that drew it.
  Large weights are ``truncate``d at ``is_cap`` (truncated IS, e.g. TIS) or the unit is ``mask``ed
  out of the loss (masked IS); ``is_cap: null`` keeps the raw weights.

Metrics (per unit, means unless named otherwise): ``algo/is_weight`` (raw weight),
``algo/is_weight_max``, ``algo/is_capped_frac`` (units truncated or masked), ``algo/behav_kl``
(``0.5 (log pi_prox - log pi_behav)^2``, how far the behaviour policy is from the proximal one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from unirl_ray.config.checks import check_literal_fields

CorrectionMode = Literal["none", "decoupled"]
CapPolicy = Literal["truncate", "mask"]


@dataclass(kw_only=True)
class OffPolicyCorrection:
    """How a PPO-style loss corrects for samples drawn by an older (behaviour) policy."""

    mode: CorrectionMode = "none"
    """``none``: ``pi_old`` = the behaviour policy; ``decoupled``: clip around the proximal policy and
    weight by ``pi_prox / pi_behav`` (see the module docstring)."""
    is_cap: float | None = 2.0
    """Upper bound of the importance weight (``decoupled``); null: no bound."""
    cap_policy: CapPolicy = "truncate"
    """What happens above ``is_cap``: ``truncate`` the weight to the cap, or ``mask`` the unit out of the loss."""

    def __post_init__(self) -> None:
        check_literal_fields(self, "off_policy")
        if self.is_cap is not None and not self.is_cap >= 1.0:
            raise ValueError(f"off_policy.is_cap must be >= 1 (or null for no cap), got {self.is_cap}")

    @classmethod
    def of(cls, value: "OffPolicyCorrection | dict[str, Any] | str | None") -> "OffPolicyCorrection":
        """From a recipe value: a mapping of the fields, a mode name, an instance or None (``none``)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(mode=value)  # type: ignore[arg-type]
        if isinstance(value, dict) or hasattr(value, "items"):
            fields = dict(value.items())
            fields.pop("_target_", None)
            unknown = sorted(set(fields) - {"mode", "is_cap", "cap_policy"})
            if unknown:
                raise ValueError(f"off_policy has unknown keys {unknown}; expected mode, is_cap, cap_policy")
            return cls(**fields)
        raise ValueError(f"off_policy must be a mapping (mode, is_cap, cap_policy) or a mode name, got {value!r}")

    @property
    def decoupled(self) -> bool:
        return self.mode == "decoupled"

    def weights(self, proximal: torch.Tensor, behaviour: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight used in the loss, raw weight, capped mask) per unit; all detached.

        ``proximal`` / ``behaviour``: log-probs of the same units (any shape). The log-ratio is
        clamped to [-20, 20] so a unit the behaviour policy found very unlikely cannot overflow.
        """
        log_w = (proximal - behaviour).detach().clamp(-20.0, 20.0)
        raw = torch.exp(log_w)
        if self.is_cap is None:
            return raw, raw, torch.zeros_like(raw, dtype=torch.bool)
        capped = raw > self.is_cap
        if self.cap_policy == "truncate":
            return raw.clamp(max=self.is_cap), raw, capped
        return torch.where(capped, torch.zeros_like(raw), raw), raw, capped


def correction_stats(raw: torch.Tensor, capped: torch.Tensor, log_gap: torch.Tensor,
                     mask: torch.Tensor | None = None) -> dict[str, float]:
    """Metric sums of the importance weights over the (masked) units, for ``TrainStack``'s reduction."""
    m = torch.ones_like(raw) if mask is None else mask.to(raw.dtype)
    any_unit = bool(m.sum() > 0)
    return {
        "is_weight": (raw * m).sum().item(),
        "is_weight_max": (raw * m).max().item() if any_unit else 0.0,
        "is_capped_frac": (capped.to(raw.dtype) * m).sum().item(),
        "behav_kl": (0.5 * log_gap.detach() ** 2 * m).sum().item(),
    }
