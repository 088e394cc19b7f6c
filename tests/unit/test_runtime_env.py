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


@pytest.mark.ray
@pytest.mark.own_ray
def test_an_embedded_ray_passes_its_variables_by_inheritance_not_a_runtime_env():
    """A real embedded Ray (a fresh interpreter): an env_vars-only runtime env is inherited by every process
    (no per-worker runtime env, whose setup process slows every actor's start), the driver's environment is
    left as it was, the train workers need no runtime env of their own, the same recipe joins the running Ray
    and another value is refused; a variable Ray itself reads (``RAY_*``) still travels as a runtime env."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import os, ray
        from unirl_ray.runtime.cluster import RayConfig, ensure_ray, inherited_env_vars, runtime_env_vars, worker_env_vars

        @ray.remote(num_cpus=0)
        def probe(name):
            return os.environ.get(name), os.environ.get("TOKENIZERS_PARALLELISM")

        cfg = RayConfig(local_num_cpus=1, runtime_env={"env_vars": {"UNIRL_MARK": "7"}})
        assert ensure_ray(cfg).startswith("embedded")
        assert "UNIRL_MARK" not in os.environ
        assert not dict(ray.get_runtime_context().runtime_env or {}).get("env_vars")
        assert ray.get(probe.remote("UNIRL_MARK"), timeout=120) == ("7", "false")
        assert worker_env_vars() is None and inherited_env_vars()["UNIRL_MARK"] == "7"
        assert ensure_ray(cfg) == "existing Ray session"
        try:
            ensure_ray(RayConfig(runtime_env={"env_vars": {"UNIRL_MARK": "8"}}))
            raise SystemExit("a different value was not refused")
        except ValueError as exc:
            assert "env_vars.UNIRL_MARK" in str(exc), exc
        ray.shutdown()
        assert inherited_env_vars() == {}
        ensure_ray(RayConfig(local_num_cpus=1, runtime_env={"env_vars": {"RAY_UNIRL_MARK": "1"}}))
        assert ray.get(probe.remote("RAY_UNIRL_MARK"), timeout=120) == ("1", "false")
        assert worker_env_vars() == runtime_env_vars() and runtime_env_vars()["TOKENIZERS_PARALLELISM"] == "false"
        ray.shutdown()
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TOKENIZERS_PARALLELISM", "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
