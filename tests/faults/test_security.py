"""Security defaults: servers bind to loopback, nothing unpickles or evaluates untrusted input, and
a cluster's ``_target_`` allow-list (``UNIRL_ALLOWED_TARGET_PREFIXES``) holds before anything runs."""

import ast
import os
from pathlib import Path

import pytest

import unirl_ray
from unirl_ray.config.recipe import RecipeError, load_recipe, validate_targets
from unirl_ray.trainer.diffusion import DiffusionTrainer

PACKAGE = Path(unirl_ray.__file__).parent
TINY = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "diffusion", "sd3", "sd3_tiny_flowgrpo.yaml")

ALLOWED_UNSAFE_CALLS = {
    # Payloads of this job's own processes (driver <-> train ranks through the broker actor), pickled
    # by ray.cloudpickle: the same trust boundary as Ray itself, which pickles every task argument.
    ("runtime/broker.py", "pickle.loads"),
    # Rows passed between this job's own async stage actors through the Ray object store: same as above.
    ("rollout/async_stream.py", "pickle.loads"),
    # Override values: yaml.load with _ValueLoader, a SafeLoader subclass (no Python object tags).
    ("config/recipe.py", "yaml.load"),
}
"""Every call the scan below flags, with why it is safe. A new one must be justified here."""


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _flag(call: ast.Call) -> str | None:
    name = _dotted(call.func)
    keywords = {k.arg: k.value for k in call.keywords}
    if name.endswith("torch.load"):
        value = keywords.get("weights_only")
        return None if isinstance(value, ast.Constant) and value.value is True else "torch.load"
    if name in {"eval", "exec", "compile", "__import__", "os.system", "os.popen", "yaml.unsafe_load",
                "marshal.loads", "shelve.open"}:
        return name
    if name.split(".")[-1] in {"load", "loads"} and name.split(".")[0] in {"pickle", "cloudpickle", "dill", "yaml"}:
        return f"{name.split('.')[0]}.{name.split('.')[-1]}"
    if name.endswith("cloudpickle.loads") or name.endswith("cloudpickle.load"):
        return "cloudpickle.load"
    shell = keywords.get("shell")
    if name.startswith("subprocess.") and isinstance(shell, ast.Constant) and shell.value is True:
        return "subprocess(shell=True)"
    return None


def test_no_unsafe_deserialisation_or_eval_outside_the_allowed_places():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (what := _flag(node)):
                found.add((path.relative_to(PACKAGE).as_posix(), what))
    assert found == ALLOWED_UNSAFE_CALLS, (
        f"new: {sorted(found - ALLOWED_UNSAFE_CALLS)}, gone (update the list): {sorted(ALLOWED_UNSAFE_CALLS - found)}")


def test_the_scan_flags_what_it_must():
    flagged = [_flag(ast.parse(code).body[0].value) for code in (
        "torch.load(f)", "torch.load(f, weights_only=False)", "eval(s)", "exec(s)", "pickle.loads(b)",
        "subprocess.run(c, shell=True)", "yaml.unsafe_load(s)")]
    assert flagged == ["torch.load", "torch.load", "eval", "exec", "pickle.loads", "subprocess(shell=True)",
                       "yaml.unsafe_load"]
    assert _flag(ast.parse("torch.load(f, weights_only=True)").body[0].value) is None
    assert _flag(ast.parse("module.eval()").body[0].value) is None


def test_checkpoint_shards_are_read_with_a_restricted_unpickler(tmp_path):
    import pickle

    from unirl_ray.train.backend.dcp_io import stored_keys

    (tmp_path / ".metadata").write_bytes(pickle.dumps(os.system))  # would run code if unpickled freely
    with pytest.raises(ValueError, match="unreadable or unsafe.*not a DCP metadata type"):
        stored_keys(str(tmp_path))


# ------------------------------------------------------------------ servers bind to loopback


def test_no_server_binds_all_interfaces_in_the_source():
    hits = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "0.0.0.0" in p.read_text()]
    assert hits == []


def test_serve_http_is_off_by_default_and_loopback_when_on(monkeypatch):
    from ray import serve

    from unirl_ray.runtime.serve import start_serve

    calls = []
    monkeypatch.setattr(serve, "start", lambda **kwargs: calls.append(kwargs))
    start_serve()
    start_serve(http_port=8123)
    assert calls[0] == {"proxy_location": "Disabled"}
    assert calls[1]["http_options"] == {"host": "127.0.0.1", "port": 8123}


def test_embedded_ray_starts_without_dashboard(monkeypatch):
    import ray

    from unirl_ray.runtime.cluster import RayConfig, ensure_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ensure_ray(RayConfig(scaling={"num_workers": 1}))
    assert calls[0]["include_dashboard"] is False


def test_printed_mlflow_ui_command_binds_loopback(tmp_path, monkeypatch):
    from unirl_ray.tracking import MLflowTracker, TrackingConfig

    tracker = MLflowTracker(TrackingConfig())
    tracker._tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"  # what start() sets for a local store
    assert "--host 127.0.0.1" in tracker.ui_command


# ------------------------------------------------------------------ _target_ allow-list


def test_allow_list_from_the_environment_refuses_a_target_before_anything_starts(monkeypatch):
    import ray

    monkeypatch.setenv("UNIRL_ALLOWED_TARGET_PREFIXES", "unirl_ray.")
    DiffusionTrainer(load_recipe(TINY))  # the shipped recipe only uses unirl_ray targets
    with pytest.raises(RecipeError, match=r"`algorithm`: _target_ 'os.system' is outside the allowed prefixes"
                                          r" \['unirl_ray.'\].*UNIRL_ALLOWED_TARGET_PREFIXES"):
        DiffusionTrainer(load_recipe(TINY, ["algorithm._target_=os.system"]))
    assert not ray.is_initialized()


@pytest.mark.parametrize("override", [
    "algorithm._target_=unirl_ray.config.recipe.os.system",  # a module an allowed package imported
    "algorithm._target_=unirl_ray.config.recipe.importlib.import_module",
    "stack._target_=unirl_ray.config.recipe.os.path.join",
    "reward.rewards.brightness.fn=unirl_ray.config.recipe.importlib.import_module",
    "reward.rewards.brightness.fn=unirl_ray.config.recipe.os.system",
])
def test_allow_list_holds_on_the_object_reached_not_the_spelling(monkeypatch, override):
    monkeypatch.setenv("UNIRL_ALLOWED_TARGET_PREFIXES", "unirl_ray.")
    with pytest.raises(RecipeError, match=r"reaches (posix|nt|os|importlib|posixpath|ntpath)\.\w+, which is outside"
                                          r" the allowed prefixes \['unirl_ray.'\]"):
        DiffusionTrainer(load_recipe(TINY, [override]))


def test_every_shipped_recipe_passes_the_allow_list_of_the_package(monkeypatch):
    for var in ("PRETRAINED_MODEL", "PRETRAINED_LLM", "CLIP_MODEL", "GSM", "SFT_DATA", "PICKSCORE_MODEL", "AESTHETIC_HEAD",
                "OCR_MODEL", "VLM_JUDGE_URL", "VLM_JUDGE_MODEL", "OWL_MODEL"):  # the real recipes' local folders (not read here)
        monkeypatch.setenv(var, "/models/unused")
    recipes = sorted(Path(TINY).parents[2].rglob("*.yaml"))
    assert len(recipes) >= 15
    for recipe in recipes:
        cfg = load_recipe(recipe)
        validate_targets(cfg, allowed_target_prefixes=["unirl_ray."])  # classes, classmethods, reward fns


def test_allow_list_also_holds_for_reward_fn_import_paths(monkeypatch):
    monkeypatch.setenv("UNIRL_ALLOWED_TARGET_PREFIXES", "unirl_ray., my_pkg.")
    with pytest.raises(RecipeError, match=r"`reward.rewards.brightness.fn`: import path 'os:system' is outside"):
        DiffusionTrainer(load_recipe(TINY, ["reward.rewards.brightness.fn=os:system"]))
    with pytest.raises(RecipeError, match=r"import path 'json.loads' is outside .*\['unirl_ray.', 'my_pkg.'\]"):
        DiffusionTrainer(load_recipe(TINY, ["reward.rewards.brightness.fn=json.loads"]))
    monkeypatch.setenv("UNIRL_ALLOWED_TARGET_PREFIXES", "")  # empty: no allow-list
    with pytest.raises(RecipeError, match="module 'json' has no attribute 'nope'"):  # no allow-list: imported
        DiffusionTrainer(load_recipe(TINY, ["reward.rewards.brightness.fn=json.nope"]))
