"""Lazy package exports: ``from unirl_ray.models.sd3 import SD3PipelineConfig`` imports only the config module (no
diffusers / transformers), and ``unirl_ray.rewards`` works without Ray; the other names are imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<exports[name]>`` when ``name`` is first used."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__
