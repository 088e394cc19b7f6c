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
from typing import Any, Literal

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


class LineageCredit(CreditAssignment):
    """Credit along a Part's lineage: a prompt -> N rewrites -> M images per rewrite (the prompt enhancer).

    The unified model's samples have the same shape (a think segment -> the images drawn from it).

    Every sample is one image: its Parts are the rewrite it was drawn from (a ``TextPart`` of stage
    ``text_stage``; the M images of one rewrite carry Parts with the same ``part_id``) and the image (the Part
    of stage ``image_stage``: a ``DiffusionPart``, or the image tokens of a discrete-token model); ``group_id`` is the prompt. ``sample.reward`` is the image's
    weighted reward. Then:

    - each image Part's reward is its sample's; its advantage is group-relative over the images of its
      rewrite (``image_group_scope: rewrite``, M per group) or of its prompt (``prompt``, N x M), or is its
      rewrite's advantage (``shared``: UniGRPO's shared advantage, what one image per text segment needs);
    - each rewrite's reward is the ``rewrite_reward`` (``mean`` or ``max``) of its images' valid rewards,
      and its advantage is group-relative over the N rewrites of its prompt; every copy of the rewrite
      Part (one per image) gets those two values.

    An invalid image reward (None / not finite) gives its image advantage 0 and stays out of its rewrite's
    reward; a rewrite none of whose images has a valid reward gets reward None and advantage 0.
    Metrics: ``credit/<text_stage>/...`` and ``credit/<image_stage>/...`` (``group_advantages``' metrics).
    """

    def __init__(self, *, text_stage: str = "ar", image_stage: str = "diffusion",
                 rewrite_reward: Literal["mean", "max"] = "mean", image_group_scope: Literal["rewrite", "prompt", "shared"] = "rewrite",
                 normalize_std: bool = True) -> None:
        from unirl_ray.config.checks import check_literal_args

        check_literal_args(LineageCredit.__init__, None, locals())
        super().__init__(algorithm=None)
        self.text_stage, self.image_stage = text_stage, image_stage
        self.rewrite_reward, self.image_group_scope, self.normalize_std = rewrite_reward, image_group_scope, normalize_std

    def assign(self, samples: list[Sample]) -> dict[str, float]:
        from unirl_ray.algorithms.advantages import group_advantages
        from unirl_ray.core.sample import DiffusionPart, Part, TextPart, routed_part

        texts = [routed_part(s, TextPart, self.text_stage) for s in samples]
        # the image Part by its stage, whatever its kind (a trajectory, or Janus' image tokens: a TextPart)
        images = [routed_part(s, DiffusionPart if self.image_stage is None else Part, self.image_stage) for s in samples]
        rewrite_of = []
        for s, text in zip(samples, texts):
            if text.part_id is None:
                raise ValueError(f"the rewrite Part of sample {s.sample_id!r} has no part_id: the images of one "
                                 "rewrite must share its id so that their rewards reach it")
            rewrite_of.append((s.group_id, text.part_id))

        rewards = [s.reward for s in samples]
        members: dict[tuple[str, str], list[float]] = {}
        for key, r in zip(rewrite_of, rewards):
            members.setdefault(key, [])
            if r is not None and math.isfinite(r):
                members[key].append(float(r))
        keys = list(members)
        pooled = [(max(v) if self.rewrite_reward == "max" else math.fsum(v) / len(v)) if v else None
                  for v in members.values()]
        rewrite_adv, rewrite_metrics = group_advantages(pooled, [g for g, _ in keys], normalize_std=self.normalize_std)
        value = {key: (r, a) for key, r, a in zip(keys, pooled, rewrite_adv)}
        for key, part in zip(rewrite_of, texts):
            part.reward, part.advantage = value[key]

        if self.image_group_scope == "shared":  # an image with an invalid reward of its own still learns nothing
            image_adv = [value[key][1] if r is not None and math.isfinite(r) else 0.0 for key, r in zip(rewrite_of, rewards)]
            image_metrics = {k: v for k, v in rewrite_metrics.items()}
        else:
            scope = rewrite_of if self.image_group_scope == "rewrite" else [(g, "") for g, _ in rewrite_of]
            image_adv, image_metrics = group_advantages(rewards, [f"{g}\x00{r}" for g, r in scope],
                                                        normalize_std=self.normalize_std)
        for s, part, adv in zip(samples, images, image_adv):
            part.reward, part.advantage = s.reward, adv
            s.advantage = None  # every Part has its own: nothing trains on a sample-level value
        return {**_under(f"credit/{self.image_stage}", image_metrics), **_under(f"credit/{self.text_stage}", rewrite_metrics),
                f"credit/{self.text_stage}/rewrites": float(len(keys))}


def _under(prefix: str, metrics: dict[str, float]) -> dict[str, float]:
    """``algo/adv_mean`` -> ``<prefix>/adv_mean``."""
    return {f"{prefix}/{key.split('/', 1)[1]}": value for key, value in metrics.items()}
