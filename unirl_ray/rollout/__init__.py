"""Rollout: producing Samples on the train ranks (trainside) or on a dedicated Serve engine."""

from unirl_ray.rollout.dedicated import DedicatedRollout
from unirl_ray.rollout.trainside import TrainsideRollout
from unirl_ray.rollout.weight_sync import TensorWeightSync

__all__ = ["DedicatedRollout", "TensorWeightSync", "TrainsideRollout"]
