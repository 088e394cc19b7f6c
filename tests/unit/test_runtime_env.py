"""``ray.runtime_env`` in a recipe, without Ray: what is checked, what the driver can import, what an embedded Ray
starts with, and when a Ray that is already running is refused. (End to end, under ``ray job submit``: a
reward from a module shipped by ``py_modules`` scores in a Serve replica with the recipe's ``env_vars``:
tests/ray/test_job_submit.py.)"""

import os
import sys

import pytest

from unirl_ray.config.recipe import RecipeError, load_recipe
from unirl_ray.runtime.cluster import (
    RayConfig,
    _session_lacks,
    add_driver_import_paths,
    check_runtime_env,
    job_runtime_env,
)
from unirl_ray.trainer.diffusion import DiffusionTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "diffusion", "sd3", "sd3_tiny_flowgrpo.yaml")


def user_package(tmp_path, name):
    """A reward module of the user's, outside every path Python searches."""
    package = tmp_path / "project" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text(
        "import os\n\n\ndef mark(*, images, prompts, **_):\n"
        "    return [float(os.environ['UNIRL_TEST_MARK'])] * len(prompts)\n")
    return package


def test_a_recipes_own_module_is_importable_on_the_driver_and_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the paths added here leave with the test
    package = user_package(tmp_path, "my_rewards_a")
    with pytest.raises(RecipeError, match="my_rewards_a"):  # not importable without the runtime env
        DiffusionTrainer(load_recipe(TINY, ["+reward.rewards.mark={fn: my_rewards_a.rewards.mark, weight: 0.0}"]))
    env = f"+ray.runtime_env={{py_modules: [{package}], env_vars: {{UNIRL_TEST_MARK: '7'}}}}"
    trainer = DiffusionTrainer(load_recipe(TINY, [env, "+reward.rewards.mark={fn: my_rewards_a.rewards.mark, weight: 0.0}"]))
    assert str(package.parent) in sys.path
    assert trainer.ray_cfg.runtime_env == {"py_modules": [str(package)], "env_vars": {"UNIRL_TEST_MARK": "7"}}
    started = job_runtime_env(trainer.ray_cfg)  # what an embedded Ray starts with
    assert started["py_modules"] == [str(package)] and started["env_vars"]["UNIRL_TEST_MARK"] == "7"
    assert started["env_vars"]["TOKENIZERS_PARALLELISM"] == "false"  # passed through from this process
    assert add_driver_import_paths({"py_modules": [str(package), "s3://bucket/mod.zip", "/no/such/dir"]}) == []
    assert add_driver_import_paths({"working_dir": str(tmp_path)}) == [str(tmp_path)]


def test_bad_runtime_envs_are_refused_with_the_reason():
    for env, match in (("pip", "must be a mapping"), ({"workdir": "."}, r"unknown field\(s\) \['workdir'\]"),
                       ({"env_vars": {"A": 1}}, "quote numbers"), ({"py_modules": "./mods"}, "list of paths")):
        with pytest.raises(ValueError, match=match):
            check_runtime_env(env)
    with pytest.raises(ValueError, match="unknown field"):
        RayConfig(runtime_env={"pip_packages": ["x"]})
    check_runtime_env({"pip": ["requests"], "env_vars": {"A": "1"}, "working_dir": "."})


def test_a_running_ray_without_the_recipes_runtime_env_is_named():
    wanted = {"py_modules": ["./m"], "env_vars": {"A": "1", "B": "2"}}
    assert _session_lacks(wanted, {"env_vars": {"A": "1"}}) == ["py_modules", "env_vars.B"]
    assert _session_lacks(wanted, {"py_modules": ["gcs://_ray_pkg_x.zip"], "env_vars": {"A": "1", "B": "2"}}) == []
    assert _session_lacks(None, {}) == [] and _session_lacks({"env_vars": {"A": "1"}}, {"env_vars": {"A": "0"}}) == ["env_vars.A"]
