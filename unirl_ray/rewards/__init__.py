"""Rewards: rule reward fns, reward config and weighting, and the Ray Serve reward service.

The Serve parts (``RewardService``, ``RewardClient``, ``build_reward_app``) are imported lazily so
that ``unirl_ray.rewards.image`` and ``unirl_ray.rewards.combine`` work without touching Ray.
"""

from unirl_ray._lazy import lazy_getattr
from unirl_ray.rewards.combine import (
    RewardConfig,
    RewardError,
    RewardFnSpec,
    combine,
    import_callable,
    reward_metrics,
    score_batch,
    score_one,
)
from unirl_ray.rewards.image import (
    brightness,
    jpeg_compressibility,
    jpeg_incompressibility,
    make_target_color,
    target_color,
)
from unirl_ray.rewards.geneval import GenEvalReward
from unirl_ray.rewards.image_model import AestheticReward, CLIPScoreReward, PickScoreReward, TemporalConsistencyReward
from unirl_ray.rewards.ocr import OCRReward

_SERVICE_NAMES = ("RewardService", "RewardClient", "RewardApp", "build_reward_app", "start_serve", "samples_to_inputs")

__all__ = [
    "RewardConfig",
    "RewardError",
    "RewardFnSpec",
    "combine",
    "import_callable",
    "reward_metrics",
    "score_batch",
    "score_one",
    "brightness",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "make_target_color",
    "target_color",
    "CLIPScoreReward",
    "PickScoreReward",
    "AestheticReward",
    "TemporalConsistencyReward",
    "OCRReward",
    "GenEvalReward",
    *_SERVICE_NAMES,
]

__getattr__ = lazy_getattr(__name__, dict.fromkeys(_SERVICE_NAMES, "service"))
