"""Rollout: producing Samples (trainside today; dedicated engines on Ray Serve build on the same contract)."""

from unirl_ray.rollout.trainside import TrainsideRollout

__all__ = ["TrainsideRollout"]
