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
    with pytest.raises(ValueError, match=r"CPU: need 200, cluster has 8"):  # the rule reward runs in the driver
        DiffusionTrainer(recipe).fit()
    recipe = load_recipe(RECIPE, [f"trainer.storage_path={tmp_path}", "ray.scaling.resources_per_worker={CPU: 100}",
                                  "++reward.placement=serve"])
    with pytest.raises(ValueError, match=r"CPU: need 200\.25, cluster has 8"):  # its replica counted
        DiffusionTrainer(recipe).fit()


def test_a_second_live_run_of_the_same_name_is_refused_before_it_deploys_anything(ray_local, tmp_path):
    """Two live jobs of one run name replaced each other's Serve apps and shared a weight store; the name
    is held by an actor owned by the driver, so a job that ended (or crashed) frees it."""
    from ray import serve

    from unirl_ray.runtime import run_lock

    held = run_lock.acquire("twin")  # a live run of this name (here: in this job)
    run_lock.RELEASE_WAIT_S, wait = 0.5, run_lock.RELEASE_WAIT_S
    try:
        recipe = load_recipe(RECIPE, [f"trainer.storage_path={tmp_path}", "trainer.run_name=twin"])
        with pytest.raises(run_lock.RunNameInUse, match=r"a run named 'twin' is live on this cluster \(job \w+\).*"
                                                        r"another trainer.run_name"):
            DiffusionTrainer(recipe).fit()
        assert not [a for a in serve.status().applications if a.startswith("twin-")]  # nothing deployed or deleted
    finally:
        run_lock.RELEASE_WAIT_S = wait
        run_lock.release(held)
    run_lock.release(run_lock.acquire("twin"))  # released: the name is free again at once


def test_no_placement_group_cleaner_without_a_state_api(ray_local):
    """Ray Train's PlacementGroupCleaner asks the State API every second whether the controller lives; the
    local Ray of the tests (like the embedded one) has no dashboard, so each question fails and the
    cleaner could only warn. The train group's TorchTrainer leaves it out there, and keeps the rest."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from unirl_ray.runtime.train_group import _torch_trainer_class, state_api_available

    assert not state_api_available()
    cls = _torch_trainer_class()
    assert issubclass(cls, TorchTrainer)
    default = [type(c) for c in TorchTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=1))._create_default_callbacks()]
    ours = [type(c) for c in cls(lambda: None, scaling_config=ScalingConfig(num_workers=1))._create_default_callbacks()]
    assert PlacementGroupCleanerCallback in default
    assert ours == [c for c in default if c is not PlacementGroupCleanerCallback]
