"""Flat OmegaConf recipes: load, override, validate and build ``_target_`` sections.

A recipe is one YAML file whose top-level sections (``bundle``, ``reward``, ``trainer``, ...) are
each built from a ``_target_`` import path: a class, a classmethod (``pkg.mod.Class.from_config``)
or a function. Nested ``_target_`` nodes are built first (depth-first) and passed in as
arguments. There are no config groups and no composition, and Hydra is not needed.

Reserved keys of a target node: ``_target_`` (the import path), ``_partial_: true`` (return a
``functools.partial`` instead of calling), ``_recursive_: false`` (pass nested ``_target_`` nodes
as plain dicts, for a component that builds its children itself, e.g. on a remote replica).

Targets are only ever imported with ``importlib`` from their module path, never evaluated; a shared
cluster can restrict them to an allow-list of module prefixes (``allowed_target_prefixes``, or the
environment variable ``UNIRL_ALLOWED_TARGET_PREFIXES=unirl_ray.,my_pkg.`` read by the trainers). The
allow-list also holds for the import paths a recipe names under an ``fn`` key (reward functions).

``validate_targets`` also checks scalar types and ``Literal`` choices against each target's annotations
(an ``int`` field given ``"abc"`` or ``1.5`` is refused with the key named), so wrong types fail before
anything runs; the helpers are ``unirl_ray.config.checks``, which components also call on construction.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import json
import logging
import pkgutil
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from unirl_ray.config.checks import allowed_kinds, bounds_of, describe_kinds, type_hints, value_fits

logger = logging.getLogger(__name__)

TARGET_KEY = "_target_"
"""The key naming the import path a node is built from."""
RESERVED_KEYS = frozenset({TARGET_KEY, "_partial_", "_recursive_"})
"""Keys of a target node that are not constructor arguments."""
MAX_PARAM_CHARS = 500
"""``flatten`` truncates each value to this many characters (MLflow params)."""
ALLOWED_PREFIXES_ENV = "UNIRL_ALLOWED_TARGET_PREFIXES"
"""Environment variable with a comma-separated allow-list of import prefixes (``unirl_ray.,my_pkg.``)."""
IMPORT_PATH_KEYS = frozenset({"fn"})
"""Keys whose string value is an import path that gets imported (a reward's ``fn``): allow-listed too."""

_OVERRIDE_KEY = re.compile(r"^(\+{0,2})([A-Za-z_][\w\-]*(?:\.[\w\-]+)*)$")
_ENV_MISSING = re.compile(r"Environment variable '([^']+)' not found")
_WRAPPED_PREFIX = re.compile(r"^\w+ raised while resolving interpolation: ")
_USAGE = "usage: python -m unirl_ray.train_<domain> RECIPE.yaml [key=value | +key=value | ~key ...]"


class RecipeError(ValueError):
    """A recipe, an override or a ``_target_`` is wrong; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# YAML values of overrides (YAML 1.2 floats: ``1e-3`` is a float, as in OmegaConf's own loader)


class _ValueLoader(yaml.SafeLoader):
    """SafeLoader whose float rule also accepts ``1e-3`` (PyYAML's YAML 1.1 rule needs a dot)."""


_ValueLoader.yaml_implicit_resolvers = {
    first: [r for r in rules if r[0] != "tag:yaml.org,2002:float"]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML (``5``, ``1e-3``, ``null``, ``[1, 2]``), else keep it."""
    if text == "":
        return ""
    try:
        return yaml.load(text, Loader=_ValueLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError:
        return text


# ----------------------------------------------------------------------------------------------
# resolvers


def assets_dir() -> Path:
    """The package's ``unirl_ray/assets`` folder."""
    import unirl_ray

    root = getattr(unirl_ray, "__file__", None)
    base = Path(root).parent if root else Path(next(iter(unirl_ray.__path__)))
    return (base / "assets").resolve()


def _asset_path(relative: str) -> str:
    """``${unirl_asset:prompts/animals.txt}`` -> absolute path of that packaged asset (a file or a folder)."""
    base = assets_dir()
    path = (base / str(relative)).resolve()
    if base not in path.parents or not (path.is_file() or path.is_dir()):
        known = sorted(str(p.relative_to(base)) for p in base.rglob("*") if "__pycache__" not in p.parts)
        close = difflib.get_close_matches(str(relative), known, n=3, cutoff=0.4)
        hint = f" Did you mean: {', '.join(close)}?" if close else f" Available: {known}."
        raise RecipeError(f"no packaged asset {relative!r} under {base}.{hint}")
    return str(path)


OmegaConf.register_new_resolver("unirl_asset", _asset_path, replace=True)


def find_recipe(relative: str | Path) -> Path:
    """A shipped recipe by its path under ``recipes/`` (``"ar/tiny/char_grpo_direct.yaml"``), for code that
    does not run from the checkout's root (a notebook kernel runs in ``notebooks/``). Looked for under
    ``$UNIRL_RAY_ROOT``, the working directory and its parents, then the checkout ``unirl_ray`` is imported
    from (an editable install)."""
    relative = Path("recipes", relative)
    roots = [Path(os.environ["UNIRL_RAY_ROOT"])] if os.environ.get("UNIRL_RAY_ROOT") else []
    roots += [Path.cwd(), *Path.cwd().parents, assets_dir().parents[1]]
    for root in roots:
        if (root / relative).is_file():
            return (root / relative).resolve()
    raise RecipeError(f"cannot find {relative} under {os.environ.get('UNIRL_RAY_ROOT') or 'the working directory'}, "
                      "its parents or the unirl_ray checkout; set UNIRL_RAY_ROOT to the checkout that has recipes/")


# ----------------------------------------------------------------------------------------------
# loading and overrides


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Read a YAML recipe, apply ``key=value`` / ``+key=value`` overrides, resolve it eagerly.

    ``key=value`` must name an existing key (its value may be null); ``+key=value`` adds a new one;
    ``++key=value`` sets a key whether or not it exists. Values are parsed as YAML.
    """
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"recipe file {str(file)!r} does not exist. {_USAGE}")
    try:
        cfg = OmegaConf.load(file)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(file)
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"malformed YAML in {where}: {problem}") from exc
    except OSError as exc:
        raise RecipeError(f"cannot read recipe {str(file)!r}: {exc}") from exc
    if not isinstance(cfg, DictConfig):
        raise RecipeError(f"recipe {str(file)!r} must be a YAML mapping of sections at top level")
    for override in overrides:
        apply_override(cfg, override)
    _resolve_all(cfg, "")
    OmegaConf.resolve(cfg)
    return cfg


def apply_override(cfg: DictConfig, override: str) -> None:
    """Apply one ``key=value`` (existing key), ``+key=value`` (new key), ``++key=value`` (either) or
    ``~key`` (delete it). A mapping value replaces the key's whole mapping (``reward.rewards={...}``)."""
    prefix, key, raw = split_override(override)
    plain = OmegaConf.to_container(cfg, resolve=False)
    exists = _lookup(plain, key.split("."))
    if prefix == "~":
        if not exists:
            raise RecipeError(f"override {override!r}: the recipe has no key {key!r} to delete.{_did_you_mean(key, plain)}")
        parent_key, _, last = key.rpartition(".")
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        del parent[int(last) if isinstance(parent, ListConfig) else last]
        return
    if prefix == "" and not exists:
        raise RecipeError(
            f"override {override!r}: the recipe has no key {key!r}.{_did_you_mean(key, plain)}"
            f" To add a new key write +{key}={raw}"
        )
    if prefix == "+" and exists:
        raise RecipeError(f"override {override!r}: {key!r} already exists; write {key}={raw}")
    try:
        OmegaConf.update(cfg, key, _parse_value(raw), merge=False, force_add=True)
    except (OmegaConfBaseException, KeyError, IndexError, ValueError, TypeError) as exc:
        raise RecipeError(f"override {override!r} cannot be applied: {exc}") from exc


def split_override(override: str) -> tuple[str, str, str]:
    """``"+a.b=1"`` -> ``("+", "a.b", "1")``, ``"~a.b"`` -> ``("~", "a.b", "")``; RecipeError on anything else."""
    if override.startswith("~") and "=" not in override and _OVERRIDE_KEY.match(override[1:].strip()):
        return "~", override[1:].strip(), ""
    key, sep, raw = override.partition("=")
    match = _OVERRIDE_KEY.match(key.strip())
    if not sep or not match:
        raise RecipeError(
            f"bad override {override!r}: overrides are key=value (existing dotted key, e.g."
            f" trainer.num_steps=5), +key=value (new key) or ~key (delete it). {_USAGE}"
        )
    return match.group(1), match.group(2), raw


def _lookup(plain: Any, parts: list[str]) -> bool:
    """Whether the dotted ``parts`` name an existing key (a null value counts) in a plain tree."""
    node = plain
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def dotted_keys(plain: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key of a plain tree, inner nodes included (list items as ``a.0``)."""
    if isinstance(plain, dict):
        items: Any = plain.items()
    else:
        items = enumerate(plain) if isinstance(plain, list) else ()
    for key, value in items:
        full = f"{prefix}.{key}" if prefix else str(key)
        yield full
        yield from dotted_keys(value, full)


def _did_you_mean(key: str, plain: Any) -> str:
    keys = list(dotted_keys(plain))
    parents = {key.rsplit(".", i)[0] for i in range(1, key.count(".") + 1)}
    keys = [k for k in keys if k not in parents]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    leaf = key.rsplit(".", 1)[-1]
    close += [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k not in close][:3]
    return f" Did you mean: {', '.join(close)}?" if close else ""


def _resolve_all(node: DictConfig | ListConfig, path: str) -> None:
    """Touch every value so interpolation errors surface here, naming the key and what to do."""
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        full = f"{path}.{key}" if path else str(key)
        try:
            value = node[key]
        except OmegaConfBaseException as exc:
            raise _interpolation_error(exc, full) from None
        if isinstance(value, (DictConfig, ListConfig)):
            _resolve_all(value, full)


def _interpolation_error(exc: OmegaConfBaseException, key: str) -> RecipeError:
    message = str(getattr(exc, "msg", None) or exc)
    env = _ENV_MISSING.search(message)
    if env:
        name = env.group(1)
        return RecipeError(
            f"`{key}` needs environment variable {name} (${{oc.env:{name}}}), which is not set."
            f" Export it (export {name}=...) or give a default: ${{oc.env:{name},default}}"
        )
    if type(exc).__name__ == "MissingMandatoryValue":
        return RecipeError(f"`{key}` is required (???): give it on the command line as {key}=...")
    return RecipeError(f"cannot resolve `{key}`: {_WRAPPED_PREFIX.sub('', message)}")


# ----------------------------------------------------------------------------------------------
# command line


def parse_cli(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``["recipe.yaml", "a.b=1", "+c=2"]`` -> ``("recipe.yaml", ["a.b=1", "+c=2"])`` (argv without
    the program name); raises RecipeError with the usage on a missing recipe or a bad override."""
    args = list(argv)
    if not args or "=" in args[0] or args[0].startswith("-"):
        raise RecipeError(f"the first argument must be the recipe YAML file. {_USAGE}")
    recipe = args[0]
    if not Path(recipe).is_file():
        if not recipe.endswith((".yaml", ".yml")):
            raise RecipeError(f"{recipe!r} is neither a recipe file nor an override: overrides look like key=value "
                              f"(e.g. trainer.num_steps=5). {_USAGE}")
        raise RecipeError(f"recipe file {recipe!r} not found (cwd: {Path.cwd()}). {_USAGE}")
    for arg in args[1:]:
        split_override(arg)
    return recipe, args[1:]


# ----------------------------------------------------------------------------------------------
# targets: import, allow-list, signature check


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _where(path: str) -> str:
    return f"`{path}`" if path else "the recipe root"


def allowed_prefixes_from_env() -> list[str] | None:
    """The allow-list in ``$UNIRL_ALLOWED_TARGET_PREFIXES`` (comma-separated); None when unset or empty."""
    raw = os.environ.get(ALLOWED_PREFIXES_ENV, "")
    prefixes = [p.strip() for p in raw.split(",") if p.strip()]
    return prefixes or None


def _is_allowed(dotted: str, allowed: Sequence[str]) -> bool:
    for prefix in allowed:
        stem = prefix.rstrip(".")
        if dotted == stem or dotted.startswith(stem + "."):
            return True
    return False


def _check_allowed(
    target: str, path: str, allowed: Sequence[str] | None, what: str = "_target_"
) -> None:
    if allowed is None or _is_allowed(target.replace(":", "."), allowed):
        return
    raise RecipeError(
        f"{_where(path)}: {what} {target!r} is outside the allowed prefixes {list(allowed)};"
        f" use one from them, or ask the cluster admin to extend {ALLOWED_PREFIXES_ENV}"
        " (or the trainer's allowed_target_prefixes)"
    )


def defined_in(obj: Any) -> str:
    """``module.qualname`` of what ``obj`` is: where a function, class or method was defined (a bound
    method: its function; an instance: its class), whatever attribute path led to it."""
    if inspect.ismodule(obj):
        return obj.__name__
    inner = getattr(obj, "__func__", obj)  # bound and class methods
    module, name = getattr(inner, "__module__", None), getattr(inner, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        module, name = type(obj).__module__, type(obj).__qualname__
    return f"{module}.{name}"


def check_reached(obj: Any, target: str, path: str, allowed: Sequence[str] | None, what: str = "_target_") -> None:
    """The allow-list holds on the object an import path reaches, not on its spelling: a module of an
    allowed package that imported ``os`` must not make ``pkg.mod.os.system`` allowed."""
    if allowed is None:
        return
    home = defined_in(obj)
    if _is_allowed(home, allowed):
        return
    raise RecipeError(
        f"{_where(path)}: {what} {target!r} reaches {home}, which is outside the allowed prefixes"
        f" {list(allowed)} (the allow-list holds on what a path reaches, not on how it is spelled);"
        f" name an object defined under them, or ask the cluster admin to extend {ALLOWED_PREFIXES_ENV}"
    )


def _import_path_values(plain: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(dotted_path, import_path)`` for string values under an ``IMPORT_PATH_KEYS`` key."""
    if isinstance(plain, dict):
        for key, value in plain.items():
            if key in IMPORT_PATH_KEYS and isinstance(value, str):
                yield _join(path, key), value
            else:
                yield from _import_path_values(value, _join(path, key))
    elif isinstance(plain, list):
        for index, value in enumerate(plain):
            yield from _import_path_values(value, _join(path, index))


def locate(target: str, path: str = "", *, what: str = "_target_") -> Any:
    """Import ``pkg.mod.Name`` or ``pkg.mod.Class.method`` with importlib; RecipeError otherwise."""
    parts = target.split(".") if isinstance(target, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise RecipeError(
            f"{_where(path)}: {what} {target!r} is not a dotted import path like 'pkg.mod.Name'"
        )
    module, used, missing = None, 0, None
    for used in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:used])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                missing = exc
                continue
            raise RecipeError(
                f"{_where(path)}: importing {name!r} for {what} {target!r} failed: {exc}"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - any import-time failure is a recipe problem here
            raise RecipeError(
                f"{_where(path)}: importing {name!r} for {what} {target!r} raised"
                f" {type(exc).__name__}: {exc}"
            ) from exc
    if module is None:
        raise RecipeError(f"{_where(path)}: {what} {target!r}: no importable module ({missing})")
    obj, owner = module, ".".join(parts[:used])
    for attr in parts[used:]:
        if not hasattr(obj, attr):
            raise _missing_attribute(obj, owner, attr, target, path, what)
        obj, owner = getattr(obj, attr), f"{owner}.{attr}"
    if not callable(obj):
        raise RecipeError(f"{_where(path)}: {what} {target!r} is not callable")
    return obj


def _missing_attribute(obj: Any, owner: str, attr: str, target: str, path: str, what: str = "_target_") -> RecipeError:
    names = [n for n in dir(obj) if not n.startswith("_")]
    kind = "attribute"
    if hasattr(obj, "__path__"):  # a package: the missing name may be a submodule
        names += [m.name for m in pkgutil.iter_modules(obj.__path__)]
        kind = "submodule or attribute"
    close = difflib.get_close_matches(attr, sorted(set(names)), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return RecipeError(
        f"{_where(path)}: {what} {target!r}: {owner!r} has no {kind} {attr!r}.{hint}"
    )


def _check_signature(
    fn: Any, node: Mapping[str, Any], path: str, injected: set[str] | None
) -> None:
    """Recipe keys must be accepted by ``fn``; with ``injected`` set, required args are checked."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: the call itself will tell
    given = [k for k in node if k not in RESERVED_KEYS]
    params = sig.parameters.values()
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in given:
        if injected and key in injected:
            raise RecipeError(
                f"`{_join(path, key)}` is supplied by the trainer at build time;"
                " remove it from the recipe"
            )
    try:
        sig.bind_partial(**{k: None for k in given})
    except TypeError:
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        unknown = [k for k in given if k not in named] if not has_var_kw else given
        ranked = difflib.get_close_matches(unknown[0], named, n=len(named), cutoff=0.0)
        raise RecipeError(
            f"`{_join(path, unknown[0])}`: {node[TARGET_KEY]} takes no argument {unknown[0]!r}."
            f" Accepted: {', '.join(ranked) or '(none)'}"
        ) from None
    if injected is not None:
        required = [p.name for p in params if p.default is p.empty and p.name in named]
        lacking = [n for n in required if n not in given and n not in injected]
        if lacking and not node.get("_partial_", False):
            raise RecipeError(
                f"{_where(path)}: {node[TARGET_KEY]} needs {', '.join(lacking)}:"
                " add them to the recipe"
            )


def _check_types(fn: Any, node: Mapping[str, Any], path: str) -> None:
    """Scalar recipe values must match the target's ``bool``/``int``/``float``/``str``/``Literal``
    annotations and their ``Bound`` ranges (``None`` and nested targets are left to the component)."""
    hints = type_hints(fn)
    for key, value in node.items():
        if key in RESERVED_KEYS or key not in hints or value is None:
            continue
        if isinstance(value, dict) and TARGET_KEY in value:
            continue
        allowed = allowed_kinds(hints[key])
        if allowed is not None and not value_fits(value, *allowed):
            raise RecipeError(
                f"`{_join(path, key)}` must be {describe_kinds(*allowed)}, got {value!r}"
                f" ({type(value).__name__}); fix it in the recipe or override it: {_join(path, key)}=..."
            )
        for bound in bounds_of(hints[key]):
            if not bound.allows(value):
                raise RecipeError(f"`{_join(path, key)}` must be {bound.describe()}, got {value!r}; fix it in the"
                                  f" recipe or override it: {_join(path, key)}=...")


def _target_nodes(plain: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    """Yield ``(dotted_path, node)`` for every target node, outer before inner."""
    if isinstance(plain, dict):
        if TARGET_KEY in plain:
            yield path, plain
        for key, value in plain.items():
            yield from _target_nodes(value, _join(path, key))
    elif isinstance(plain, list):
        for index, value in enumerate(plain):
            yield from _target_nodes(value, _join(path, index))


def _to_plain(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(node, resolve=True)
        except OmegaConfBaseException as exc:
            raise RecipeError(f"cannot resolve the recipe: {exc}") from exc
    return node


def validate_targets(
    cfg: DictConfig | Mapping[str, Any],
    *,
    extra_kwargs: Mapping[str, set[str]] | None = None,
    allowed_target_prefixes: Sequence[str] | None = None,
) -> None:
    """Check every ``_target_``: allowed, importable, its node's keys match its signature and its
    scalar values the annotated types; import paths under ``fn`` keys must be allowed too.

    ``extra_kwargs`` maps a section's dotted path (e.g. ``"algorithm"``) to the argument names the
    trainer injects when it builds that section (e.g. ``{"pipeline"}``); for such sections missing
    required arguments are reported too, and a recipe key clashing with an injected one is an error.
    Sections not listed only get ``bind_partial`` checks (missing arguments are not reported).
    """
    extra = dict(extra_kwargs or {})
    plain = _to_plain(cfg)
    for path, value in _import_path_values(plain):
        _check_allowed(value, path, allowed_target_prefixes, what="import path")
        if allowed_target_prefixes is not None:
            check_reached(locate(value.replace(":", "."), path, what="import path"), value, path,
                          allowed_target_prefixes, what="import path")
    for path, node in _target_nodes(plain):
        target = node[TARGET_KEY]
        if not isinstance(target, str):
            raise RecipeError(
                f"{_where(path)}: _target_ must be a dotted import path, got {target!r}"
            )
        _check_allowed(target, path, allowed_target_prefixes)
        fn = locate(target, path)
        check_reached(fn, target, path, allowed_target_prefixes)
        _check_signature(fn, node, path, set(extra[path]) if path in extra else None)
        _check_types(fn, node, path)


# ----------------------------------------------------------------------------------------------
# building


def instantiate(
    node: DictConfig | ListConfig | Mapping[str, Any] | Sequence[Any],
    /,
    *,
    allowed_target_prefixes: Sequence[str] | None = None,
    **kwargs: Any,
) -> Any:
    """Build ``node`` (nested targets first); ``kwargs`` go to the top-level call only.

    A node without ``_target_`` comes back as plain containers with any nested targets built.
    A constructor's ``ValueError``/``TypeError`` is re-raised as RecipeError naming the key path.
    """
    path = ""
    if isinstance(node, (DictConfig, ListConfig)):
        try:
            path = node._get_full_key(None) or ""  # noqa: SLF001 - the node's dotted key in its recipe
        except Exception:  # noqa: BLE001 - only used for messages
            path = ""
    plain = _to_plain(node)
    if kwargs and not (isinstance(plain, dict) and TARGET_KEY in plain):
        raise RecipeError(
            f"{_where(path)} has no _target_, so keyword arguments {sorted(kwargs)} cannot be given"
        )
    return _build(plain, path, allowed_target_prefixes, kwargs)


def _build(
    value: Any, path: str, allowed: Sequence[str] | None, extra: dict[str, Any] | None = None
) -> Any:
    if isinstance(value, list):
        return [_build(item, _join(path, i), allowed) for i, item in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if TARGET_KEY not in value:
        return {key: _build(item, _join(path, key), allowed) for key, item in value.items()}
    return _call_target(value, path, allowed, extra or {})


def _call_target(
    node: dict, path: str, allowed: Sequence[str] | None, extra: dict[str, Any]
) -> Any:
    target = node[TARGET_KEY]
    if not isinstance(target, str):
        raise RecipeError(
            f"{_where(path)}: _target_ must be a dotted import path string, got {target!r}"
        )
    _check_allowed(target, path, allowed)
    fn = locate(target, path)
    check_reached(fn, target, path, allowed)
    recursive = bool(node.get("_recursive_", True))
    args = {
        key: (_build(item, _join(path, key), allowed) if recursive else item)
        for key, item in node.items()
        if key not in RESERVED_KEYS
    }
    clash = sorted(set(args) & set(extra))
    if clash:
        logger.warning("%s: recipe values of %s are replaced by the caller's", _where(path), clash)
    args.update(extra)
    if node.get("_partial_", False):
        return functools.partial(fn, **args)
    try:
        return fn(**args)
    except RecipeError:
        raise
    except (ValueError, TypeError) as exc:
        raise RecipeError(
            f"building {_where(path)} ({target}) failed: {type(exc).__name__}: {exc}"
        ) from exc


# ----------------------------------------------------------------------------------------------
# output


def flatten(cfg: DictConfig | Mapping[str, Any]) -> dict[str, str]:
    """Dotted keys -> string values (JSON for non-strings, <= 500 chars), e.g. for MLflow params.

    Lists of scalars stay one value (``"[1, 2]"``); lists holding mappings are indexed (``a.0.b``).
    """
    out: dict[str, str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and (value or not key):
            for child, item in value.items():
                walk(item, _join(key, child))
        elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            for index, item in enumerate(value):
                walk(item, _join(key, index))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[key] = text[:MAX_PARAM_CHARS]

    walk(_to_plain(cfg), "")
    return out


def to_yaml(cfg: DictConfig | Mapping[str, Any]) -> str:
    """The resolved recipe as YAML text (what gets logged to MLflow)."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_yaml(cfg, resolve=True)
    return OmegaConf.to_yaml(OmegaConf.create(dict(cfg)), resolve=True)
