"""Keep transformers from importing scikit-learn in this project's processes.

transformers' generation module (which every model class pulls in) imports scikit-learn, and through
it scipy, whenever it is installed: ~1 s per process, for one feature, the dynamic confidence threshold
of assisted (speculative) decoding, which this project never uses. mlflow depends on scikit-learn, so it
is always installed here, and every train worker, engine replica and reward-model replica paid that
second at start. This finder makes transformers' generation code see scikit-learn as absent (the same
code path as an environment without it); scikit-learn itself stays importable. Set
``UNIRL_TRANSFORMERS_SKLEARN=1`` to leave transformers alone.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

_TARGET = "transformers.generation.candidate_generator"


class _NoSklearnForGeneration(importlib.abc.MetaPathFinder):
    """Just before transformers' candidate generator is imported, report scikit-learn as unavailable to it."""

    done = False

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 - MetaPathFinder protocol
        # (sys.meta_path is being iterated here: the finder stays in it and only does its work once)
        if fullname == _TARGET and not self.done:
            self.done = True
            for name in ("transformers.utils", "transformers.utils.import_utils"):
                module = sys.modules.get(name)
                if module is not None and hasattr(module, "is_sklearn_available"):
                    module.is_sklearn_available = _unavailable
        return None  # the regular finders import the module


def _unavailable() -> bool:
    return False


def install() -> None:
    if os.environ.get("UNIRL_TRANSFORMERS_SKLEARN") == "1" or _TARGET in sys.modules:
        return
    if not any(isinstance(f, _NoSklearnForGeneration) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoSklearnForGeneration())
