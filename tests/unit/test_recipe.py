"""Recipes: loading, overrides, interpolation errors, ``_target_`` validation and building."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from unirl_ray.config import (
    RecipeError,
    flatten,
    instantiate,
    load_recipe,
    parse_cli,
    to_yaml,
    validate_targets,
)
from unirl_ray.config import recipe as recipe_mod

HERE = __name__  # tests are imported as a module, so targets can point at classes defined here


@dataclass(kw_only=True)
class Scorer:
    """A leaf component."""

    weight: float = 1.0
    """Scale of the score."""

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError("weight must be >= 0")


@dataclass(kw_only=True)
class Service:
    """A component holding built children and a caller-injected argument."""

    scorers: dict[str, Scorer]
    """Built nested targets."""
    names: list[str] = field(default_factory=list)
    """A plain list."""
    bundle: object = None
    """Injected by the caller at build time."""

    @classmethod
    def from_config(cls, *, scorers: dict[str, Scorer], bundle: object) -> Service:
        return cls(scorers=scorers, bundle=bundle)


def add(a: int, b: int = 0) -> int:
    return a + b


RECIPE = f"""
trainer:
  num_steps: 10
  lr: 1.0e-4
reward:
  _target_: {HERE}.Service
  names: [a, b]
  scorers:
    brightness:
      _target_: {HERE}.Scorer
      weight: 1.0
backend:
  lora_cfg: null
"""


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture
def recipe_path(tmp_path: Path) -> str:
    return write(tmp_path, RECIPE)


# ---------------------------------------------------------------- loading and overrides


def test_overrides_nested_null_and_yaml_values(recipe_path: str) -> None:
    cfg = load_recipe(
        recipe_path,
        [
            "trainer.num_steps=5",
            "trainer.lr=3e-4",
            "reward.scorers.brightness.weight=0.5",
            "backend.lora_cfg={rank: 4}",
            "reward.names=[x]",
        ],
    )
    assert cfg.trainer.num_steps == 5
    assert cfg.trainer.lr == pytest.approx(3e-4)  # YAML 1.2 float, not the string "3e-4"
    assert cfg.reward.scorers.brightness.weight == 0.5
    assert cfg.backend.lora_cfg.rank == 4
    assert list(cfg.reward.names) == ["x"]
    assert load_recipe(recipe_path, ["backend.lora_cfg=null"]).backend.lora_cfg is None


def test_unknown_override_key_suggests_the_close_valid_key(recipe_path: str) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe_path, ["reward.scorers.brightnes.weight=0.5"])
    assert "reward.scorers.brightness.weight" in str(err.value)
    assert "+reward.scorers.brightnes.weight" in str(err.value)
    with pytest.raises(RecipeError, match="trainer.num_steps"):
        load_recipe(recipe_path, ["trainer.num_step=5"])


def test_plus_adds_a_new_key_and_refuses_an_existing_one(recipe_path: str) -> None:
    cfg = load_recipe(recipe_path, ["+new.key=1", "++trainer.seed=3"])
    assert cfg.new.key == 1 and cfg.trainer.seed == 3
    with pytest.raises(RecipeError, match="already exists"):
        load_recipe(recipe_path, ["+trainer.num_steps=1"])


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(RecipeError, match=r"malformed YAML in .*recipe\.yaml, line \d+"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(write(tmp_path, "- 1\n- 2\n", "list.yaml"))


def test_missing_env_var_is_named_and_default_works(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("UNIRL_TEST_MODEL", raising=False)
    path = write(tmp_path, "model:\n  path: ${oc.env:UNIRL_TEST_MODEL}\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert "UNIRL_TEST_MODEL" in message and "model.path" in message and "export" in message
    default = write(tmp_path, "model:\n  path: ${oc.env:UNIRL_TEST_MODEL,tiny}\n", "d.yaml")
    assert load_recipe(default).model.path == "tiny"
    monkeypatch.setenv("UNIRL_TEST_MODEL", "/models/sd3")
    assert load_recipe(path).model.path == "/models/sd3"


def test_missing_mandatory_value_says_how_to_give_it(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"model\.path=\.\.\."):
        load_recipe(write(tmp_path, "model:\n  path: ???\n"))


def test_asset_resolver(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "assets" / "prompts").mkdir(parents=True)
    (tmp_path / "assets" / "prompts" / "animals.txt").write_text("cat\n")
    monkeypatch.setattr(recipe_mod, "assets_dir", lambda: tmp_path / "assets")
    path = write(tmp_path, "data:\n  prompts: ${unirl_asset:prompts/animals.txt}\n")
    assert load_recipe(path).data.prompts == str(tmp_path / "assets" / "prompts" / "animals.txt")
    folder = write(tmp_path, "data:\n  prompts: ${unirl_asset:prompts}\n", "folder.yaml")  # a folder of files
    assert load_recipe(folder).data.prompts == str(tmp_path / "assets" / "prompts")
    bad = write(tmp_path, "data:\n  prompts: ${unirl_asset:prompts/animal.txt}\n", "bad.yaml")
    with pytest.raises(RecipeError, match=r"data\.prompts.*prompts/animals\.txt"):
        load_recipe(bad)
    outside = write(tmp_path, "data:\n  prompts: ${unirl_asset:..}\n", "outside.yaml")
    with pytest.raises(RecipeError, match="no packaged asset"):
        load_recipe(outside)


# ---------------------------------------------------------------- targets


def test_validate_accepts_the_recipe_and_injected_kwargs(recipe_path: str) -> None:
    cfg = load_recipe(recipe_path)
    validate_targets(cfg)
    validate_targets(cfg, extra_kwargs={"reward": {"bundle"}})


def test_bad_target_module_names_the_key_path(tmp_path: Path) -> None:
    cfg = load_recipe(write(tmp_path, "reward:\n  _target_: unirl_nope_pkg.mod.Thing\n"))
    with pytest.raises(RecipeError, match=r"`reward`.*unirl_nope_pkg\.mod\.Thing"):
        validate_targets(cfg)


def test_bad_target_attribute_suggests_close_names(tmp_path: Path) -> None:
    text = f"reward:\n  scorers:\n    - _target_: {HERE}.Scorr\n"
    cfg = load_recipe(write(tmp_path, text))
    with pytest.raises(RecipeError) as err:
        validate_targets(cfg)
    message = str(err.value)
    assert "`reward.scorers.0`" in message and "Scorr" in message and "Scorer" in message


def test_unknown_constructor_kwarg_lists_accepted_names(tmp_path: Path) -> None:
    text = f"reward:\n  _target_: {HERE}.Scorer\n  wieght: 2.0\n"
    with pytest.raises(RecipeError) as err:
        validate_targets(load_recipe(write(tmp_path, text)))
    assert "`reward.wieght`" in str(err.value) and "Accepted: weight" in str(err.value)


def test_injected_kwargs_required_and_clashing(tmp_path: Path) -> None:
    text = f"algo:\n  _target_: {HERE}.add\n"
    cfg = load_recipe(write(tmp_path, text))
    validate_targets(cfg)  # bind_partial: a missing required arg is fine without extra_kwargs
    validate_targets(cfg, extra_kwargs={"algo": {"a"}})
    with pytest.raises(RecipeError, match="needs a"):
        validate_targets(cfg, extra_kwargs={"algo": {"b"}})
    clash = load_recipe(write(tmp_path, text + "  a: 1\n", "clash.yaml"))
    with pytest.raises(RecipeError, match="supplied by the trainer"):
        validate_targets(clash, extra_kwargs={"algo": {"a"}})


def test_instantiate_nested_targets_and_caller_kwargs(recipe_path: str) -> None:
    cfg = load_recipe(recipe_path, ["reward.scorers.brightness.weight=0.25"])
    bundle = object()
    service = instantiate(cfg.reward, bundle=bundle)
    assert isinstance(service, Service) and service.bundle is bundle
    assert service.scorers == {"brightness": Scorer(weight=0.25)}
    assert service.names == ["a", "b"] and type(service.names) is list
    assert instantiate(cfg.trainer) == {"num_steps": 10, "lr": pytest.approx(1e-4)}


def test_classmethod_partial_and_non_recursive_targets() -> None:
    node = {
        "_target_": f"{HERE}.Service.from_config",
        "scorers": {"s": {"_target_": f"{HERE}.Scorer", "weight": 2.0}},
    }
    assert instantiate(node, bundle=1).scorers["s"].weight == 2.0
    part = instantiate({"_target_": f"{HERE}.add", "_partial_": True, "b": 2})
    assert isinstance(part, functools.partial) and part(a=1) == 3
    raw = instantiate(
        {"_target_": f"{HERE}.Service", "_recursive_": False, "scorers": node["scorers"]}
    )
    assert raw.scorers == node["scorers"]


def test_constructor_value_error_is_rewrapped_with_key_path(recipe_path: str) -> None:
    cfg = load_recipe(recipe_path, ["reward.scorers.brightness.weight=-1"])
    with pytest.raises(RecipeError, match=r"`reward\.scorers\.brightness`.*weight must be >= 0"):
        instantiate(cfg.reward, bundle=None)


def test_allow_list_refuses_foreign_targets(recipe_path: str) -> None:
    cfg = load_recipe(recipe_path)
    with pytest.raises(RecipeError, match="allowed prefixes"):
        validate_targets(cfg, allowed_target_prefixes=["unirl_ray"])
    with pytest.raises(RecipeError, match=r"`reward`.*allowed prefixes"):
        instantiate(cfg.reward, allowed_target_prefixes=["unirl_ray"], bundle=None)
    node = {"_target_": "os.system", "command": "true"}
    with pytest.raises(RecipeError, match="os.system"):
        instantiate(node, allowed_target_prefixes=["unirl_ray", "os.path"])
    validate_targets(cfg, allowed_target_prefixes=[HERE])


# ---------------------------------------------------------------- output and CLI


def test_flatten_and_to_yaml(recipe_path: str) -> None:
    cfg = load_recipe(recipe_path, [f"+notes={'x' * 600}"])
    flat = flatten(cfg)
    assert flat["trainer.num_steps"] == "10"
    assert flat["reward.scorers.brightness._target_"] == f"{HERE}.Scorer"
    assert flat["reward.names"] == '["a", "b"]'
    assert flat["backend.lora_cfg"] == "null"
    assert len(flat["notes"]) == 500
    assert all(isinstance(v, str) for v in flat.values())
    assert "num_steps: 10" in to_yaml(cfg)


def test_parse_cli(recipe_path: str) -> None:
    assert parse_cli([recipe_path, "a.b=1", "+c=x"]) == (recipe_path, ["a.b=1", "+c=x"])
    with pytest.raises(RecipeError, match="first argument must be the recipe"):
        parse_cli([])
    with pytest.raises(RecipeError, match="first argument must be the recipe"):
        parse_cli(["trainer.num_steps=5"])
    with pytest.raises(RecipeError, match="not found"):
        parse_cli(["/nonexistent/recipe.yaml"])
    with pytest.raises(RecipeError, match="bad override 'num_steps'"):
        parse_cli([recipe_path, "num_steps"])
    with pytest.raises(RecipeError, match="bad override"):
        parse_cli([recipe_path, "--lr=3"])


def test_help_deletion_and_mapping_replacement(capsys):
    from unirl_ray.cli import run_trainer
    from unirl_ray.trainer.diffusion import DiffusionTrainer

    tiny = str(Path(__file__).resolve().parents[2] / "recipes" / "diffusion" / "sd3" / "sd3_tiny_flowgrpo.yaml")
    assert run_trainer(DiffusionTrainer, ["--help"], default_recipe=tiny) == 0
    out = capsys.readouterr().out
    assert f"recipe: {tiny} (the default)" in out and "~tracking.log_samples_every" in out
    assert "  algorithm       unirl_ray.algorithms.FlowGRPO" in out and "reward.rewards={" in out
    cfg = load_recipe(tiny, ["~tracking.log_samples_every", "reward.rewards={b: {fn: unirl_ray.rewards.image.jpeg_compressibility}}"])
    assert "log_samples_every" not in cfg.tracking
    assert list(cfg.reward.rewards) == ["b"]  # the whole mapping replaced, not merged with brightness
    with pytest.raises(RecipeError, match=r"no key 'tracking.nope' to delete"):
        load_recipe(tiny, ["~tracking.nope"])
