"""``unirl_ray/README.md`` is generated from the source by ``python -m unirl_ray.tools.reference``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from unirl_ray.tools import reference
from unirl_ray.tools.reference import build_reference

REPO = Path(__file__).resolve().parents[2]
STALE = "unirl_ray/README.md is stale: run `python -m unirl_ray.tools.reference`"


@pytest.fixture(scope="module")
def ref() -> reference.Reference:
    return build_reference()


def _section(text: str, name: str) -> str:
    """The text under ``### `name``` up to the next heading."""
    match = re.search(rf"^### `{re.escape(name)}`\n(.*?)(?=^#|\Z)", text, re.S | re.M)
    assert match, f"the reference has no section for {name}"
    return match.group(1)


def _row(section: str, name: str) -> list[str] | None:
    """Cells (type, default, description) of the table row of ``name``, pipes unescaped."""
    match = re.search(rf"^\| `{re.escape(name)}` \| (.*) \|$", section, re.M)
    if match is None:
        return None
    return [c.replace("\\|", "|") for c in re.split(r"(?<!\\) \| ", match.group(1))]


def _write_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "unirl_ray"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return pkg


def test_committed_reference_is_current(ref):
    committed = reference.OUTPUT.read_text(encoding="utf-8") if reference.OUTPUT.is_file() else ""
    if committed != ref.text:
        pytest.fail(STALE, pytrace=False)


def test_check_flags_a_stale_file_without_touching_it(tmp_path, capsys):
    out = tmp_path / "README.md"
    out.write_text("an old reference\n", encoding="utf-8")
    assert reference.main(["--check", "--output", str(out)]) == 1
    assert out.read_text(encoding="utf-8") == "an old reference\n"
    assert "is stale: run `python -m unirl_ray.tools.reference`" in capsys.readouterr().err


def test_every_train_config_field_is_in_the_reference_with_its_default(ref):
    import unirl_ray.train.configs as configs
    from unirl_ray.train.stack import TrainStackConfig

    schemas = [c for _, c in inspect.getmembers(configs, inspect.isclass)
               if dataclasses.is_dataclass(c) and c.__module__ == configs.__name__]
    assert {"FSDPConfig", "LoraConfig", "OptimizerConfig", "LrSchedulerConfig", "TrainTopology"} <= {
        c.__name__ for c in schemas}
    checked = 0
    for cls in [*schemas, TrainStackConfig]:
        section = _section(ref.text, cls.__name__)
        for f in dataclasses.fields(cls):
            cells = _row(section, f.name)
            assert cells is not None, f"{cls.__name__}.{f.name} is missing from unirl_ray/README.md"
            _, default, _ = cells
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                assert default == "*required*", (cls.__name__, f.name, default)
                continue
            want = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            try:
                shown = ast.literal_eval(default.strip("`"))
            except (ValueError, SyntaxError):
                continue  # a default that is an expression (a constant's name) is shown as written
            assert shown == want, f"{cls.__name__}.{f.name}: the reference says {shown!r}, the class {want!r}"
            checked += 1
    assert checked >= 20


def test_package_config_fields_all_have_docstrings(ref):
    assert not ref.undocumented, (
        "config fields without a docstring (add a string literal right under each field, then run "
        "`python -m unirl_ray.tools.reference`):\n" + "\n".join(ref.undocumented))


def test_no_public_dataclass_is_outside_the_documented_areas(ref):
    assert not ref.uncovered, (
        "public dataclasses in packages the reference does not cover; add the package to AREAS or "
        "NOT_COMPONENTS in unirl_ray/tools/reference.py:\n" + "\n".join(ref.uncovered))


def test_every_recipe_target_and_reward_fn_is_in_the_reference(ref):
    names: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("_target_", "fn") and isinstance(value, str):
                    names.add(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    for path in sorted((REPO / "recipes").rglob("*.yaml")):
        walk(yaml.safe_load(path.read_text(encoding="utf-8")))
    assert len(names) >= 15, sorted(names)
    missing = [n for n in sorted(names) if f"`{n}`" not in ref.text and f"`_target_: {n}`" not in ref.text]
    assert not missing, f"recipe targets with no entry in unirl_ray/README.md: {missing}"


def test_output_is_deterministic_and_machine_independent(ref):
    assert build_reference().text == ref.text
    assert str(REPO) not in ref.text and str(Path.home()) not in ref.text
    assert not re.search(r"0x[0-9a-f]{6,}", ref.text)


def test_undocumented_field_is_reported_and_marked(tmp_path):
    pkg = _write_package(tmp_path, {
        "train/__init__.py": "",
        "train/configs.py": '''
            from dataclasses import dataclass

            @dataclass(kw_only=True)
            class DemoConfig:
                """A demo schema."""

                documented: int = 1
                """Has a docstring."""
                bare: str = "x"
            ''',
    })
    got = build_reference(pkg)
    assert got.undocumented == ["unirl_ray/train/configs.py:9 DemoConfig.bare"]
    section = _section(got.text, "DemoConfig")
    assert _row(section, "bare") == ["`str`", "`'x'`", "*(undocumented)*"]
    assert _row(section, "documented") == ["`int`", "`1`", "Has a docstring."]


def test_reading_the_source(tmp_path):
    """Re-exports, Literal aliases (local and imported), quoted annotations, inherited fields, ClassVar,
    default factories, **kwargs forwarding, ``Args:`` sections, injected arguments, what is not a component."""
    pkg = _write_package(tmp_path, {
        "algorithms/__init__.py": "from unirl_ray.algorithms.algo import Child\n",
        "algorithms/kinds.py": "from typing import Literal\n\nKind = Literal['x', 'y']\n",
        "algorithms/algo.py": '''
            from dataclasses import dataclass, field
            from typing import Any, ClassVar, Literal

            from unirl_ray.algorithms.kinds import Kind

            Mode = Literal["a", "b"]

            @dataclass(kw_only=True)
            class BaseConfig:
                """Base."""

                mode: Mode = "a"
                """How."""
                kind: "Kind | None" = None
                """Which kind."""

            @dataclass(kw_only=True, frozen=True)
            class ChildConfig(BaseConfig):
                """Child."""

                flag: ClassVar[bool] = True
                names: list[str] = field(default_factory=lambda: ["q", "k"])
                """Which."""
                mode: Mode = "b"
                """Overridden."""

            class Parent:
                """The parent."""

                def __init__(self, *, size: int = 2, pipeline: Any = None) -> None:
                    """
                    Args:
                        size: How many,
                            over two lines.
                    """

            class Child(Parent):
                """The child.

                More text that is not shown.
                """

                def __init__(self, *, extra: float = 0.5, **kwargs: Any) -> None:
                    super().__init__(**kwargs)

            class NotReexported:
                def __init__(self, x: int) -> None:
                    pass

            class Failure(ValueError):
                """Not a component."""
            ''',
    })
    got = build_reference(pkg)
    text = got.text
    child_cfg = _section(text, "ChildConfig")
    assert "Dataclass (keyword-only, frozen). Subclass of `BaseConfig`." in child_cfg
    assert _row(child_cfg, "mode") == ["`Literal['a', 'b']`", "`'b'`", "Overridden."]
    assert _row(child_cfg, "names") == ["`list[str]`", "`['q', 'k']`", "Which."]
    assert _row(child_cfg, "kind") == ["`Literal['x', 'y'] | None`", "`None`", "Which kind. *(from `BaseConfig`)*"]
    assert _row(child_cfg, "flag") is None  # ClassVar: not a field
    assert child_cfg.index("`mode`") < child_cfg.index("`names`")  # inherited fields keep their place
    child = _section(text, "Child")
    assert "`unirl_ray.algorithms.algo.Child` (also `unirl_ray.algorithms.Child`)" in child
    assert _row(child, "extra") == ["`float`", "`0.5`", ""]
    assert _row(child, "size") == ["`int`", "`2`", "How many, over two lines. *(from `Parent`)*"]
    assert _row(child, "pipeline")[2].startswith("*Injected:* the built `pipeline:` section")
    assert "The child." in child and "More text" not in child
    # classes of a module outside MODULE_ORDER that no package re-exports, and an exception: not components
    assert "### `Parent`" not in text and "### `NotReexported`" not in text and "### `Failure`" not in text
    assert [c.rpartition(".")[2] for c in got.components] == ["BaseConfig", "ChildConfig", "Child"]
