"""Stage algorithms (pure torch, no Ray)."""

from unirl_ray.algorithms.advantages import group_advantages
from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.algorithms.flow_grpo import FlowGRPO

__all__ = ["FlowGRPO", "LossContext", "StageAlgorithm", "group_advantages"]
