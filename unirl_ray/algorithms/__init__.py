"""Stage algorithms (pure torch, no Ray)."""

from unirl_ray.algorithms.advantages import group_advantages
from unirl_ray.algorithms.base import LossContext, StageAlgorithm
from unirl_ray.algorithms.diffusion_nft import DiffusionNFT
from unirl_ray.algorithms.flow_grpo import FlowGRPO
from unirl_ray.algorithms.grpo import DAPO, GRPO, RLOO, DrGRPO
from unirl_ray.algorithms.sft import SFT

__all__ = [
    "DAPO",
    "GRPO",
    "RLOO",
    "SFT",
    "DiffusionNFT",
    "DrGRPO",
    "FlowGRPO",
    "LossContext",
    "StageAlgorithm",
    "group_advantages",
]
