"""The train side: FSDPBackend (owns the model) and TrainStack / UnifiedModelTrainStack (own the loss/backward
ordering of one stage / of several stages over one backend)."""

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
from unirl_ray.train.stack import TrainStack, UnifiedModelTrainStack

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
    "UnifiedModelTrainStack",
]
