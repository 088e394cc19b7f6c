"""Distributed backends that own the trainable model (FSDP2 today)."""

from unirl_ray.train.backend.fsdp import FSDPBackend

__all__ = ["FSDPBackend"]
