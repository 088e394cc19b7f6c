"""Credit assignment: the driver stage between reward and train that decides what each sample and each
Part trains on.

``RLTrainer.learn`` runs it on every step's scored samples, before the train ranks see them:
``trainer.assign_credit(step, samples)`` -> ``CreditAssignment``. The default is the stage algorithm's own
``compute_advantages`` (group-relative, leave-one-out, ...) over the whole step, which is what a
single-side trainer needs. Trainers whose samples hold several Parts (a rewrite and the images drawn from
it) subclass ``CreditAssignment`` and override ``assign``: they give Parts their own ``reward`` /
``advantage`` (``core.sample.Part``), which cross to the ranks intact (``core.sample.complete_sample``).

Every assignment first checks that the step has something to learn from: a step in which no sample has
a usable reward (sources that fail or time out under ``reward.on_error: skip``) is counted, and
``ALL_INVALID_STEPS`` such steps in a row stop the run with the cause instead of training on nothing.
"""

from __future__ import annotations

import math
from typing import Any

from unirl_ray.core.sample import Sample

ALL_INVALID_STEPS = 3
"""Steps in a row without one usable reward after which a run stops."""


class CreditAssignment:
    """The default credit assignment: the algorithm's ``compute_advantages`` (see the module docstring)."""

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm
        self.all_invalid_steps = 0

    def __call__(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """Check that ``samples`` can teach anything, then assign; returns the stage's metrics."""
        self.check_usable(step, samples)
        return self.assign(samples)

    def assign(self, samples: list[Sample]) -> dict[str, float]:
        """Set the advantages of ``samples`` (and of their Parts) in place; returns ``algo/`` metrics."""
        return self.algorithm.compute_advantages(samples)

    def check_usable(self, step: int, samples: list[Sample]) -> None:
        """``RuntimeError`` once every sample's reward has been invalid for ``ALL_INVALID_STEPS`` steps in a row."""
        usable = any(s.reward is not None and math.isfinite(s.reward) for s in samples)
        self.all_invalid_steps = 0 if usable else self.all_invalid_steps + 1
        if self.all_invalid_steps >= ALL_INVALID_STEPS:
            raise RuntimeError(
                f"steps {step - self.all_invalid_steps + 1}..{step}: every sample's reward was invalid (None or not "
                "finite), so nothing was learned: the reward sources fail or time out (see the warnings above and "
                "reward/invalid_frac, reward/<name>/* in MLflow). Fix the reward fn, or raise reward.timeout_s"
            )
