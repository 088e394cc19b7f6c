"""Recipes: flat OmegaConf YAML files whose sections are built from ``_target_`` import paths."""

from unirl_ray.config.recipe import (
    RecipeError,
    apply_override,
    assets_dir,
    flatten,
    instantiate,
    load_recipe,
    locate,
    parse_cli,
    to_yaml,
    validate_targets,
)

__all__ = [
    "RecipeError",
    "apply_override",
    "assets_dir",
    "flatten",
    "instantiate",
    "load_recipe",
    "locate",
    "parse_cli",
    "to_yaml",
    "validate_targets",
]
