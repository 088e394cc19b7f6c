"""Values checked against their annotations: one mechanism for recipes and for Python callers.

A field or parameter typed ``Literal[...]`` (alone, in an alias, or in a union such as
``Literal["auto"] | int | None``) lists its allowed values once, in the annotation; a numeric one
carries its range the same way, ``Annotated[float, Bound(gt=0)] | None``. Components do not repeat
either in a hand-written check; they call ``check_literal_fields(self)`` from ``__post_init__``
(dataclasses) or ``check_literal_args(Class.__init__, prefix, locals())`` (constructors), which
read the annotation (choices and ranges both). ``unirl_ray.config.recipe.validate_targets`` checks
recipe values with the same helpers (scalar types too) before anything is built, naming the recipe key.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

SCALARS: dict[type, str] = {
    bool: "a boolean (true/false)",
    int: "an int (a whole number)",
    float: "a number",
    str: "a string (quote it in YAML)",
}
"""Scalar annotation types a recipe value is checked against, with how a message names them."""


@dataclasses.dataclass(frozen=True)
class Bound:
    """A numeric range, given in an annotation: ``Annotated[int, Bound(ge=1)]``,
    ``Annotated[float, Bound(gt=0)] | None``. ``why`` ends the message (e.g. what ``None`` means)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    why: str = ""

    def allows(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True  # the type check names a wrong type
        if value != value:  # NaN fits no range
            return False
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))

    def describe(self) -> str:
        parts = [f"{op} {limit:g}" for op, limit in (("> ", self.gt), (">=", self.ge), ("< ", self.lt), ("<=", self.le))
                 if limit is not None]
        text = " and ".join(p.replace("  ", " ") for p in parts)
        return f"{text} ({self.why})" if self.why else text


PositiveInt = typing.Annotated[int, Bound(ge=1)]
"""An int >= 1 (counts, sizes, steps)."""
NonNegativeInt = typing.Annotated[int, Bound(ge=0)]
PositiveFloat = typing.Annotated[float, Bound(gt=0)]


def bounds_of(annotation: Any) -> list[Bound]:
    """The ``Bound`` markers of an annotation (in ``Annotated[...]``, also inside a union)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return [m for m in annotation.__metadata__ if isinstance(m, Bound)]
    if origin in (typing.Union, types.UnionType):
        return [b for arm in typing.get_args(annotation) for b in bounds_of(arm)]
    return []


def check_bounds(name: str, value: Any, annotation: Any) -> None:
    """ValueError ``"<name> must be > 0, got -1"`` when ``value`` is outside a ``Bound`` of the annotation."""
    for bound in bounds_of(annotation):
        if not bound.allows(value):
            raise ValueError(f"{name} must be {bound.describe()}, got {value!r}")


def type_hints(fn: Any) -> dict[str, Any]:
    """Resolved annotations of ``fn``'s parameters (a class: its dataclass fields or ``__init__``),
    ``Annotated`` extras kept; ``{}`` when they cannot be resolved."""
    try:
        if isinstance(fn, type):
            hints = typing.get_type_hints(fn, include_extras=True) if dataclasses.is_dataclass(fn) else {}
            return hints or typing.get_type_hints(fn.__init__, include_extras=True)
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # noqa: BLE001 - unresolvable annotations: the component checks its own values
        return {}


def allowed_kinds(annotation: Any) -> tuple[list[Any], list[Any]] | None:
    """``(scalar types, literal choices)`` an annotation allows (``None`` arms dropped); None if it is
    not that simple (a container, a class, ``Any``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return allowed_kinds(typing.get_args(annotation)[0])
    if origin is Literal:
        return [], list(typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        scalars: list[Any] = []
        choices: list[Any] = []
        for arm in typing.get_args(annotation):
            if arm is type(None):
                continue
            inner = allowed_kinds(arm)
            if inner is None:
                return None
            scalars += inner[0]
            choices += inner[1]
        return scalars, choices
    if annotation in SCALARS:
        return [annotation], []
    return None


def value_fits(value: Any, scalars: list[Any], choices: list[Any]) -> bool:
    """Whether ``value`` is one of ``choices`` (same type too: ``True`` is not ``1``) or of a scalar type."""
    if any(value == c and type(value) is type(c) for c in choices):
        return True
    for kind in scalars:
        if kind is bool and isinstance(value, bool):
            return True
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if kind is str and isinstance(value, str):
            return True
    return False


def describe_choices(choices: list[Any]) -> str:
    """``['a', 'b', 'c']`` -> ``"one of 'a', 'b' or 'c'"``; one choice -> ``"'a'"``."""
    shown = [repr(c) for c in choices]
    if len(shown) == 1:
        return shown[0]
    return f"one of {', '.join(shown[:-1])} or {shown[-1]}"


def describe_kinds(scalars: list[Any], choices: list[Any]) -> str:
    """What a value must be: ``"an int (a whole number) or 'auto'"``, ``"one of 'a' or 'b'"``."""
    wanted = [SCALARS[k] for k in scalars] + ([describe_choices(choices)] if choices else [])
    return " or ".join(wanted)


def _allows_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _allows_none(typing.get_args(annotation)[0])
    if origin is Literal:
        return None in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_allows_none(arm) for arm in typing.get_args(annotation))
    return False


@functools.lru_cache(maxsize=None)
def _literal_hints(owner: Any) -> tuple[tuple[str, Any, tuple[list[Any], list[Any]]], ...]:
    """``(name, annotation, (scalars, choices))`` of every field / parameter of ``owner`` whose
    annotation holds Literal choices or a ``Bound``."""
    if isinstance(owner, type):
        names = [f.name for f in dataclasses.fields(owner)]
    else:
        names = [n for n in getattr(owner, "__annotations__", {}) if n != "return"]
    hints = _resolve(owner, names)
    out = []
    for name in names:
        if name not in hints:
            continue
        kinds = allowed_kinds(hints[name])
        if kinds is not None and (kinds[1] or bounds_of(hints[name])):
            out.append((name, hints[name], kinds))
    return tuple(out)


def _resolve(owner: Any, names: list[str]) -> dict[str, Any]:
    """Resolved annotations; if one of them cannot be resolved (a name imported only for type
    checking), the others still are, one by one."""
    try:
        return typing.get_type_hints(owner, include_extras=True)
    except Exception:  # noqa: BLE001 - fall back to resolving each annotation on its own
        pass
    if isinstance(owner, type):
        raw: dict[str, Any] = {}
        for cls in reversed(owner.__mro__):
            raw.update(getattr(cls, "__annotations__", {}))
        module = sys.modules.get(owner.__module__)
    else:
        raw = dict(getattr(owner, "__annotations__", {}))
        module = sys.modules.get(getattr(owner, "__module__", ""))
    namespace = dict(vars(module)) if module is not None else {}
    out: dict[str, Any] = {}
    for name in names:
        if name not in raw:
            continue
        holder = type("_OneAnnotation", (), {"__annotations__": {name: raw[name]}})
        try:
            out[name] = typing.get_type_hints(holder, globalns=namespace, include_extras=True)[name]
        except Exception:  # noqa: BLE001 - this one stays unchecked
            continue
    return out


def check_choice(name: str, value: Any, annotation: Any) -> None:
    """ValueError ``"<name> must be one of 'a' or 'b', got 'c'"`` when ``value`` does not fit an
    annotation that holds Literal choices, or ``"<name> must be > 0, got -1"`` when it is outside its
    ``Bound`` (``None`` passes where the annotation allows it)."""
    kinds = allowed_kinds(annotation)
    if kinds is None:
        return
    if value is None and _allows_none(annotation):
        return
    if kinds[1] and not value_fits(value, *kinds):
        raise ValueError(f"{name} must be {describe_kinds(*kinds)}, got {value!r}")
    check_bounds(name, value, annotation)


def check_literal_fields(obj: Any, prefix: str | None = None) -> None:
    """Check every ``Literal``-typed or ``Bound``-annotated field of the dataclass instance ``obj``.

    Messages name the field as ``<prefix>.<field>`` (``prefix`` defaults to the class name), the
    value and the allowed values. Call it from ``__post_init__``.
    """
    owner = type(obj)
    where = owner.__name__ if prefix is None else prefix
    for name, annotation, _ in _literal_hints(owner):
        check_choice(f"{where}.{name}" if where else name, getattr(obj, name), annotation)


def check_literal_args(fn: Any, prefix: str | None, values: Mapping[str, Any]) -> None:
    """Check the arguments in ``values`` (e.g. ``locals()`` at the top of ``__init__``) whose
    parameter of ``fn`` is ``Literal``-typed or ``Bound``-annotated; messages name them as ``<prefix>.<name>``."""
    for name, annotation, _ in _literal_hints(fn):
        if name in values:
            check_choice(f"{prefix}.{name}" if prefix else name, values[name], annotation)
