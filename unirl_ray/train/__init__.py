"""The train side: FSDPBackend (owns the model) and TrainStack (owns loss/backward ordering)."""

from unirl_ray.train.backend.fsdp import FSDPBackend
from unirl_ray.train.configs import (
    EmaFullConfig,
    EmaLoraConfig,
    FSDPConfig,
    LoraConfig,
    LrSchedulerConfig,
    OptimizerConfig,
    TrainTopology,
)
from unirl_ray.train.stack import TrainStack

__all__ = [
    "EmaFullConfig",
    "EmaLoraConfig",
    "FSDPBackend",
    "FSDPConfig",
    "LoraConfig",
    "LrSchedulerConfig",
    "OptimizerConfig",
    "TrainStack",
    "TrainTopology",
]
