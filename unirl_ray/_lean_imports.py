"""Keep transformers and diffusers from importing scikit-learn and scipy at import time.

Every train worker, engine replica and reward-model replica imports transformers (and the diffusion
ones diffusers). Both import optional backends eagerly for features this project never touches at
start-up, and mlflow depends on scikit-learn and scipy, so they are always installed here:

- transformers' generation module imports scikit-learn (and through it scipy), ~1 s, for the
  confidence threshold of assisted (speculative) decoding;
- transformers' object-detection losses (imported by every model class) import
  ``scipy.optimize.linear_sum_assignment``, ~0.7 s, for DETR-style Hungarian matching;
- diffusers' schedulers import ``scipy.stats``, ~0.4 s, for ``use_beta_sigmas``.

A meta-path finder wraps the loading of exactly those modules: while one executes, the library's
``is_<backend>_available()`` answers False, so its module-level import is skipped. Afterwards the
check is the real one again and the skipped names are lazy stand-ins that import their backend on
first use, so assisted decoding, a DETR loss or a beta-sigma scheduler still works unchanged. Set ``UNIRL_LEAN_IMPORTS=0`` (or the older
``UNIRL_TRANSFORMERS_SKLEARN=1``) to leave both libraries alone.
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys
import types
from typing import Any

_SCIPY_OPTIMIZE = {"linear_sum_assignment": ("scipy.optimize", "linear_sum_assignment")}
_TRANSFORMERS_UTILS = ("transformers.utils", "transformers.utils.import_utils")
_DIFFUSERS_UTILS = ("diffusers.utils", "diffusers.utils.import_utils")
# module -> (the utils modules whose availability check it imports, the check's name,
#            {name the skipped import would have bound: (module, attribute or None for the module)})
_EXACT: dict[str, tuple[tuple[str, ...], str, dict[str, Any]]] = {
    "transformers.generation.candidate_generator": (
        _TRANSFORMERS_UTILS, "is_sklearn_available", {"roc_curve": ("sklearn.metrics", "roc_curve")}),
}
# prefix -> rule: `if is_scipy_available(): from scipy.optimize import linear_sum_assignment` in the
# DETR-family losses; `if is_scipy_available(): import scipy.stats` in diffusers' schedulers
_PREFIXES = {
    "transformers.loss.loss_": (_TRANSFORMERS_UTILS, "is_scipy_available", _SCIPY_OPTIMIZE),
    "diffusers.schedulers.scheduling_": (_DIFFUSERS_UTILS, "is_scipy_available", {"scipy": ("scipy", None)}),
}


def _rule(fullname: str):
    if fullname in _EXACT:
        return _EXACT[fullname]
    return next((rule for prefix, rule in _PREFIXES.items() if fullname.startswith(prefix)), None)


def _unavailable() -> bool:
    return False


_REAL: dict[tuple[str, str], Any] = {}  # (utils module, check name) -> the library's own check


class _LazyModule(types.ModuleType):
    """Stands for a package (``scipy``) in a module's namespace; ``scipy.stats`` imports it when used."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        package = importlib.import_module(self.__name__)
        try:
            return getattr(package, attr)
        except AttributeError:
            return importlib.import_module(f"{self.__name__}.{attr}")


def _lazy_function(module: str, name: str):
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``{module}.{name}``, imported on first call."
    return call


def _stand_in(module: str, name: str | None) -> Any:
    return _LazyModule(module) if name is None else _lazy_function(module, name)


class _Loader(importlib.abc.Loader):
    """The real loader, run with the backend check answering False; then the lazy stand-ins."""

    def __init__(self, loader: importlib.abc.Loader, rule) -> None:
        self.loader = loader
        self.rule = rule

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def __getattr__(self, name: str) -> Any:  # get_source (tracebacks), get_filename, resource readers...
        return getattr(self.loader, name)

    def exec_module(self, module: types.ModuleType) -> None:
        utils_names, check, stand_ins = self.rule
        patched, real = [], None
        for name in utils_names:
            utils = sys.modules.get(name)
            current = getattr(utils, check, None)
            if current is _unavailable:  # nested: a module being loaded this way imports another one
                real = _REAL.get((name, check), real)
            elif callable(current):
                real = _REAL[(name, check)] = current
                patched.append((utils, current))
                setattr(utils, check, _unavailable)
        try:
            self.loader.exec_module(module)
        finally:
            for utils, current in patched:
                setattr(utils, check, current)
        if real is None:
            return
        if module.__dict__.get(check) is _unavailable:
            setattr(module, check, real)  # runtime checks in the module give the real answer
        source = self._source(module.__name__)
        for attr, (target, name) in stand_ins.items():
            if attr not in module.__dict__ and (source is None or attr in source):
                setattr(module, attr, _stand_in(target, name))

    def _source(self, fullname: str) -> str | None:
        try:
            return self.loader.get_source(fullname)
        except Exception:  # noqa: BLE001 - no source (e.g. a bytecode-only install): give every stand-in
            return None


class _LeanFinder(importlib.abc.MetaPathFinder):
    """Finds the listed modules with the other finders and wraps their loader (see the module docstring)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - MetaPathFinder protocol
        rule = _rule(fullname)
        if rule is None:
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _LeanFinder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, rule)
                return spec
        return None


def enabled() -> bool:
    return os.environ.get("UNIRL_LEAN_IMPORTS", "1") != "0" and os.environ.get("UNIRL_TRANSFORMERS_SKLEARN") != "1"


def install() -> None:
    if enabled() and not any(isinstance(f, _LeanFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LeanFinder())
