"""Data contracts shared by every stage: Sample, Part, TrainStepResult."""

from unirl_ray.core.sample import DiffusionPart, Part, Sample, TextPart, TrainStepResult

__all__ = ["DiffusionPart", "Part", "Sample", "TextPart", "TrainStepResult"]
