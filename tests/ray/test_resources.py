"""A run the cluster can never hold fails at once, naming the missing resources (no silent wait)."""

import os

import pytest

from unirl_ray.config.recipe import load_recipe
from unirl_ray.trainer.diffusion import DiffusionTrainer

pytestmark = pytest.mark.ray

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "diffusion", "sd3", "sd3_tiny_flowgrpo.yaml")


def test_unschedulable_workers_fail_fast_with_names(ray_local, tmp_path):
    recipe = load_recipe(RECIPE, [f"trainer.storage_path={tmp_path}", "ray.scaling.resources_per_worker={CPU: 1, GPU: 1}"])
    with pytest.raises(ValueError, match=r"GPU: need 2, cluster has 0"):
        DiffusionTrainer(recipe).fit()
    recipe = load_recipe(RECIPE, [f"trainer.storage_path={tmp_path}", "ray.scaling.resources_per_worker={CPU: 100}"])
    with pytest.raises(ValueError, match=r"CPU: need 200\.25, cluster has 8"):
        DiffusionTrainer(recipe).fit()
