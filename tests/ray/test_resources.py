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


def test_ray_train_starts_its_controller_and_workers_without_a_runtime_env_where_they_inherit_its_settings(
        ray_local, tmp_path, monkeypatch):
    """Ray Train gives its controller and each worker a runtime env of its ``RAY_TRAIN_*`` settings, so each of
    them started through Ray's setup process (~0.5 CPU-s and a process start more, 2.2 s of a cold start on 2
    cores). Where every process of the Ray inherited those settings (the embedded Ray, and the tests'), the
    train group's trainer starts them without one; they still see the settings. A setting the driver changed
    after Ray started is not inherited: Ray Train's own path is taken."""
    import json

    import ray
    from ray._private.state import actors
    from ray.train import RunConfig, ScalingConfig

    from unirl_ray.runtime.train_group import _controller_env_inherited, _torch_trainer_class

    def loop():
        import ray.train

        rank = ray.train.get_context().get_world_rank()
        seen = {"runtime_env_vars": dict(ray.get_runtime_context().runtime_env or {}).get("env_vars") or {},
                "poll": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(seen))

    assert _controller_env_inherited()
    _torch_trainer_class(with_datasets=False)(
        loop, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name="inherited", storage_path=str(tmp_path / "runs"))).fit()
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"runtime_env_vars": {}, "poll": "0.5"}
    classes = [a["ActorClassName"] for a in actors().values()]
    assert "InheritedEnvController" in classes, classes
    assert ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")  # created by the driver
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.4")
    assert not _controller_env_inherited()
