"""Data plane: prompt sources read with Ray Data."""

from unirl_ray.data.prompts import PromptSource

__all__ = ["PromptSource"]
