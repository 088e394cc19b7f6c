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
    if any(a in ("-h", "--help") for a in args):
        given = next((a for a in args if a.endswith((".yaml", ".yml"))), None)
        print(help_text(trainer_cls, given or default_recipe, default=given is None))
        return 0
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


def help_text(trainer_cls: type, recipe: str | None, *, default: bool = False) -> str:
    """What ``--help`` prints: the recipe it would run, its sections and the override syntax."""
    lines = [f"Train with {trainer_cls.__name__} on Ray.", "",
             "usage: python recipes/<domain>.py [RECIPE.yaml] [key=value | +key=value | ~key ...]", ""]
    if recipe:
        lines += [f"recipe: {recipe}" + (" (the default)" if default else ""), "sections (override any key below them):"]
        try:
            cfg = load_recipe(recipe)
            for name in cfg:
                node = cfg[name]
                target = node.get("_target_") if hasattr(node, "get") else None
                keys = [k for k in node if k != "_target_"] if hasattr(node, "keys") else []
                if target is None and keys and all(hasattr(node[k], "get") and node[k].get("_target_") for k in keys):
                    target = "stages: " + ", ".join(f"{k}={node[k].get('_target_').rsplit('.', 1)[-1]}" for k in keys)
                lines.append(f"  {name:<15} {target or ''}  [{', '.join(map(str, keys[:8]))}{', ...' if len(keys) > 8 else ''}]")
        except RecipeError as exc:
            lines.append(f"  (cannot read it: {exc})")
    lines += ["", "overrides (values are YAML):",
              "  trainer.num_steps=5                    set an existing key",
              "  +trainer.export_dir=/tmp/model         add a key the recipe does not have",
              "  ++key=value                            set it either way",
              "  reward.rewards={b: {fn: unirl_ray.rewards.image.brightness}}   replace a whole mapping",
              "  ~tracking.log_samples_every            delete a key (its default applies)",
              "  trainer.run_name=my-run                a new run (the same name and storage path resume)",
              "", "Every field of every section, with types and defaults: unirl_ray/README.md"]
    return "\n".join(lines)
