"""Shared command-line handling of the ``train_<domain>`` entry points."""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from unirl_ray.config.recipe import RecipeError, load_recipe, parse_cli


def run_trainer(trainer_cls: type, argv: Sequence[str], default_recipe: str | None = None) -> int:
    """Load and validate the recipe, then fit; recipe errors print one clear line and exit 2."""
    logging.basicConfig(level=os.environ.get("UNIRL_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    args = list(argv)
    if default_recipe and (not args or not (args[0].endswith((".yaml", ".yml")) or os.path.isfile(args[0]))):
        args.insert(0, default_recipe)  # only overrides given (a bad one is named as such by parse_cli)
    try:
        path, overrides = parse_cli(args)
        recipe = load_recipe(path, overrides)
        trainer = trainer_cls(recipe)
    except RecipeError as exc:
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    try:
        trainer.fit()
    except RecipeError as exc:  # found when the run starts (e.g. resuming with a changed recipe)
        print(f"recipe error: {exc}", file=sys.stderr)
        return 2
    return 0
