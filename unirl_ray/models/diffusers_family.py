"""What the diffusers-folder families (SD3, Wan) share: the config base and the bundle base.

A family config names a local diffusers pipeline folder (``model_index.json`` plus one sub-folder
per component) or nothing, which builds the family's tiny random demo model; a family bundle holds
the pipeline's components as dataclass fields named like the diffusers pipeline's constructor
arguments, so one base can wrap, rebuild, move and save any of them.

Light on purpose: no diffusers / transformers import (the family configs import this module, and
drivers validate configs without those libraries).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl_ray.core.dtypes import TORCH_DTYPES

@dataclass(kw_only=True)
class DiffusersFolderConfig:
    """Which diffusers pipeline folder to load and in which dtype (base of the family configs)."""

    family: ClassVar[str]
    """Family name in messages (``"SD3"``)."""
    folder_kind: ClassVar[str]
    """What a valid folder is, completing "expected a local diffusers ..."."""
    written_by: ClassVar[str]
    """Where a folder comes from, completing "expected a folder written by ..."."""
    dtype_fields: ClassVar[tuple[str, ...]] = ("torch_dtype",)
    """Fields that must name a key of ``TORCH_DTYPES``."""

    pretrained_model_ckpt_path: str | None = None
    """Local diffusers pipeline folder (with ``model_index.json``); ``None`` builds the tiny random DEMO model."""
    torch_dtype: str = "float32"
    """Weight dtype (the VAE's too unless the family has a VAE dtype field): ``float32``, ``bfloat16``, ``float16``."""

    def __post_init__(self) -> None:
        for name in self.dtype_fields:
            if getattr(self, name) not in TORCH_DTYPES:
                raise ValueError(f"{name} must be one of {sorted(TORCH_DTYPES)}, got {getattr(self, name)!r}")
        if self.pretrained_model_ckpt_path is not None:
            self._check_folder(self.pretrained_model_ckpt_path)

    def _check_folder(self, path: str) -> None:
        """Raise ``ValueError`` unless ``path`` is a folder with ``model_index.json``."""
        if not os.path.isdir(path):
            raise ValueError(
                f"pretrained_model_ckpt_path {path!r} does not exist or is not a folder; expected a local "
                f"diffusers {self.folder_kind}, or leave it unset (null) to use the tiny demo model"
            )
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise ValueError(
                f"pretrained_model_ckpt_path {path!r} has no model_index.json; expected a folder written by "
                f"{self.written_by}"
            )

    @property
    def is_demo(self) -> bool:
        """True when no checkpoint is given and the tiny random model is used."""
        return self.pretrained_model_ckpt_path is None

    @property
    def dtype(self) -> torch.dtype:
        """``torch_dtype`` as a ``torch.dtype``."""
        return TORCH_DTYPES[self.torch_dtype]

    def _component_config(self, component: str) -> dict:
        """``<folder>/<component>/config.json`` as a dict (checkpoint configs only)."""
        assert self.pretrained_model_ckpt_path is not None
        path = os.path.join(self.pretrained_model_ckpt_path, component, "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"{path!r} is missing; the {self.family} folder {self.pretrained_model_ckpt_path!r} needs "
                f"a {component}/ sub-folder with config.json"
            )
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def validate_frame_size(height: int, width: int, factor: int, why: str) -> None:
    """Raise ``ValueError`` (with the nearest valid size) unless ``height`` and ``width`` are positive
    multiples of ``factor``; ``why`` says where the factor comes from."""
    if height <= 0 or width <= 0 or height % factor or width % factor:
        raise ValueError(
            f"height x width = {height} x {width} must be positive multiples of {factor} ({why}); e.g. use "
            f"{max(factor, height - height % factor)} x {max(factor, width - width % factor)}"
        )


_BUNDLE_FIELDS = ("config", "is_demo", "_pipe")
"""Fields of a family bundle that are not pipeline components."""


class DiffusersBundle:
    """Behaviour shared by the family bundles: wrapping, moving, rebuilding and saving a diffusers pipeline.

    A family bundle is a ``kw_only`` dataclass subclass whose fields are the pipeline's components,
    named like the diffusers pipeline's constructor arguments, followed by ``config``, ``is_demo``
    and ``_pipe`` (the cached pipeline).
    """

    pipeline_class_name: ClassVar[str]
    """The diffusers pipeline class the components belong to, by its name in ``diffusers`` (imported on first use,
    ``pipeline_class()``: a driver that only checks a recipe's targets does not import diffusers)."""
    frozen_components: ClassVar[tuple[str, ...]]
    """Components that are never trained (frozen by ``from_diffusers``)."""
    media: ClassVar[str]
    """What the model generates, in the demo warning (``"images"``)."""

    @classmethod
    def pipeline_class(cls) -> type:
        """The diffusers pipeline class named by ``pipeline_class_name``."""
        import diffusers

        return getattr(diffusers, cls.pipeline_class_name)

    @classmethod
    def components(cls) -> tuple[str, ...]:
        """Names of the component fields, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in _BUNDLE_FIELDS)

    @classmethod
    def _warn_demo(cls, config: Any) -> None:
        logging.getLogger(cls.__module__).warning(
            "%s: no pretrained_model_ckpt_path given; building a TINY RANDOMLY INITIALISED DEMO model "
            "(%s). Its %s are noise-like: set pretrained_model_ckpt_path for real training.",
            config.family, config.tiny, cls.media,
        )

    @staticmethod
    def _cast(modules: list[torch.nn.Module], dtype: torch.dtype) -> None:
        for module in modules:
            # plain nn.Module.to: the diffusers override warns about (no) fp32 modules on every cast
            torch.nn.Module.to(module, dtype=dtype)

    @classmethod
    def from_diffusers(cls, pipe: Any, *, config: Any) -> Any:
        """Wrap the components of an existing diffusers pipeline (freezes the non-trained parts)."""
        parts = {name: getattr(pipe, name) for name in cls.components()}
        bundle = cls(**parts, config=config, is_demo=config.is_demo, _pipe=pipe)
        for module in bundle.frozen_modules():
            module.eval()
            module.requires_grad_(False)
        return bundle

    def frozen_modules(self) -> list[torch.nn.Module]:
        """The present ``frozen_components`` (VAE and text encoders: never trained)."""
        mods = [getattr(self, name) for name in self.frozen_components]
        return [m for m in mods if m is not None]

    @property
    def device(self) -> torch.device:
        """Device of the VAE (where prompts are encoded and media decoded)."""
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Transformer / text encoder dtype from the config."""
        return self.config.dtype

    def to(self, device: torch.device | str) -> Any:
        """Move every component (transformer included) to ``device``; returns ``self``."""
        for module in [self.transformer, *self.frozen_modules()]:
            module.to(device)
        return self

    def diffusers_pipeline(self) -> Any:
        """A ``pipeline_class()`` over these components (used for prompt encoding)."""
        if self._pipe is None:
            self._pipe = self._new_pipeline()
        return self._pipe

    def _new_pipeline(self) -> Any:
        return self.pipeline_class()(**{name: getattr(self, name) for name in self.components()})

    def save_pretrained(self, directory: str) -> str:
        """Write every component as a diffusers ``pipeline_class()`` folder; returns its ``transformer/``.

        The folder (``model_index.json`` and one sub-folder per component) loads with
        ``pipeline_class().from_pretrained(directory)``, its transformer alone with the transformer
        class's ``from_pretrained(directory, subfolder="transformer")``, and it is a valid
        ``pretrained_model_ckpt_path``.
        """
        pipe = self._new_pipeline()  # built anew: the cached pipeline may hold replaced components
        os.makedirs(directory, exist_ok=True)
        pipe.save_pretrained(directory)
        return os.path.join(directory, "transformer")
