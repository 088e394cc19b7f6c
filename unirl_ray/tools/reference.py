"""Write ``unirl_ray/README.md``: every recipe component and every config field, from the source.

    python -m unirl_ray.tools.reference            # rewrite unirl_ray/README.md
    python -m unirl_ray.tools.reference --check    # exit 1 if it is stale or a field has no docstring

Discovery walks the package's source (``ast``; nothing is imported). Each area below is a
sub-package; in it, every public top-level class that is a dataclass or has a constructor (its own
or inherited from a package class) is a component, except exceptions and the Ray / Serve plumbing
listed in ``INTERNAL_MODULES`` / ``INTERNAL_CLASSES``. Reward functions (public functions taking
keyword-only ``completions`` or ``images``) are listed under rewards. Modules keep the reading
order of ``MODULE_ORDER``; others follow alphabetically; classes keep their source order.

A dataclass field is documented by the string literal right under it. Fields without one are
reported (and make ``--check`` and the unit test fail); so are public dataclasses in packages
that no area covers, so a new config schema cannot be left out silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from unirl_ray.tools.source_index import ClassInfo, FunctionInfo, PackageIndex, Param, first_paragraph

PACKAGE = "unirl_ray"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
OUTPUT = PACKAGE_DIR / "README.md"
COMMAND = "python -m unirl_ray.tools.reference"

AREAS: tuple[tuple[str, str, str], ...] = (
    ("train", "unirl_ray.train",
     "The `backend:` and `stack:` sections: `FSDPBackend` (FSDP2, LoRA, AdamW, checkpoints) and `TrainStack`, "
     "with their config schemas."),
    ("algorithms", "unirl_ray.algorithms", "The `algorithm:` section: stage algorithms (pure torch)."),
    ("models", "unirl_ray.models", "The `bundle:` and `pipeline:` sections: model families."),
    ("rollout", "unirl_ray.rollout", "The `rollout:` and `sync:` sections, and an agentic recipe's `agent:` section."),
    ("rewards", "unirl_ray.rewards",
     "The `reward:` section: `RewardConfig`, one `RewardFnSpec` per source, the reward functions it can name."),
    ("data", "unirl_ray.data", "The `data:` section: prompt sources."),
    ("tracking", "unirl_ray.tracking", "The `tracking:` section and the tracker it configures."),
    ("runtime", "unirl_ray.runtime", "The `ray:` section."),
    ("agentic", "unirl_ray.agentic",
     "The `environment:` section of an agentic recipe: the environment contract, `ToolEnvironment`, the tools an "
     "agent calls (the calculator, sandboxed Python) and the limits of the sandbox its code runs in."),
    ("trainers", "unirl_ray.trainer",
     "The `trainer:` section (a `RunConfig`) and the domain trainers that run a recipe "
     "(`python -m unirl_ray.train_ar` / `train_diffusion` / `train_async_ar` / `train_async_diffusion` / `train_sft` / "
     "`train_pe` / `train_unified_model` / `train_agentic`)."),
)
"""(title, package, what it holds) in the order the reference shows them."""

NOT_COMPONENTS = ("unirl_ray.core", "unirl_ray.config", "unirl_ray.serve", "unirl_ray.tools")
"""Packages that hold no recipe components (data records, the recipe loader, the policy server, this tool)."""

MODULE_ORDER: tuple[str, ...] = (
    "unirl_ray.train.configs",
    "unirl_ray.train.stack",
    "unirl_ray.train.backend.fsdp",
    "unirl_ray.algorithms.base",
    "unirl_ray.algorithms.grpo",
    "unirl_ray.algorithms.flow_grpo",
    "unirl_ray.algorithms.off_policy",
    "unirl_ray.models.causal_lm.config",
    "unirl_ray.models.causal_lm.bundle",
    "unirl_ray.models.causal_lm.pipeline",
    "unirl_ray.models.diffusers_family",
    "unirl_ray.models.sd3.config",
    "unirl_ray.models.sd3.bundle",
    "unirl_ray.models.sd3.pipeline",
    "unirl_ray.rollout.trainside",
    "unirl_ray.rollout.dedicated",
    "unirl_ray.rollout.weight_sync",
    "unirl_ray.rewards.combine",
    "unirl_ray.rewards.image",
    "unirl_ray.rewards.text",
    "unirl_ray.rewards.model",
    "unirl_ray.trainer.base",
    "unirl_ray.trainer.rl",
    "unirl_ray.trainer.ar",
    "unirl_ray.trainer.diffusion",
    "unirl_ray.trainer.async_rl",
)
"""Reading order of modules inside an area; modules not named here follow alphabetically."""

INTERNAL_MODULES = (
    "unirl_ray.runtime.broker",
    "unirl_ray.runtime.serve",
    "unirl_ray.train.rank",
    "unirl_ray.runtime.timeouts",
    "unirl_ray.runtime.train_group",
    "unirl_ray.runtime.version_gate",
    "unirl_ray.runtime.worker",
    "unirl_ray.rewards.service",
    "unirl_ray.rollout.async_stream",
    "unirl_ray.rollout.engines",
    "unirl_ray.train.backend.dcp_io",
)
"""Plumbing that a recipe never names (a name here covers its sub-modules)."""

INTERNAL_CLASSES = ("unirl_ray.rollout.dedicated.DedicatedEngine", "unirl_ray.agentic.sandbox.SandboxResult",
                    "unirl_ray.agentic.tool_calls.ToolCall", "unirl_ray.rollout.dedicated.EngineSet", "unirl_ray.models.unified.model.UnifiedTransformer",
                    "unirl_ray.models.janus.bundle.JanusPolicy", "unirl_ray.models.janus.bundle.ImageTokenOutput",
                    "unirl_ray.models.janus.pipeline.JanusImageTokens", "unirl_ray.rollout.manager.RolloutManager",
                    "unirl_ray.rollout.manager.Trajectory", "unirl_ray.agentic.environment.EnvStep",
                    "unirl_ray.trainer.agentic.TurnCredit")
"""Classes of documented modules that a recipe never names."""

RECIPE_FACTORIES = ("from_config",)
"""Classmethods a recipe calls as ``_target_: pkg.Class.from_config``."""

INJECTED = {
    "bundle": "the built `bundle:` section",
    "pipeline": "the built `pipeline:` section",
    "backend": "the rank's `FSDPBackend`",
    "fsdp_backend": "the rank's `FSDPBackend`",
    "algorithm": "the built `algorithm:` section",
}
"""Constructor arguments the framework passes when it builds the worker sections; not set in a recipe."""

REWARD_INPUTS = ("images", "prompts", "completions")
"""Keyword arguments every reward function receives from the framework."""


@dataclass(kw_only=True)
class Reference:
    """The generated text and what it found missing."""

    text: str
    """The Markdown of ``unirl_ray/README.md``."""
    undocumented: list[str] = field(default_factory=list)
    """``path:line Class.field`` of public dataclass fields without a docstring."""
    undocumented_classes: list[str] = field(default_factory=list)
    """``path:line Class`` of components without a class docstring."""
    uncovered: list[str] = field(default_factory=list)
    """``path:line Class`` of public dataclasses in packages that no area (nor ``NOT_COMPONENTS``) covers."""
    components: list[str] = field(default_factory=list)
    """Qualified names of the documented classes and functions, in output order."""


# ---------------------------------------------------------------------------------------------
# discovery


def _under(module: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _area_modules(index: PackageIndex, package: str) -> list[str]:
    names = [m for m in index.modules if _under(m, package) and not _under(m, INTERNAL_MODULES)]
    rank = {m: i for i, m in enumerate(MODULE_ORDER)}
    return sorted(names, key=lambda m: (rank.get(m, len(rank)), m))


def _is_component(index: PackageIndex, cls: ClassInfo) -> bool:
    """Public dataclasses always; other classes with a constructor when their module is a component
    module (``MODULE_ORDER``) or a package re-exports them (helpers of new modules stay out)."""
    if cls.name.startswith("_") or cls.qualname in INTERNAL_CLASSES or index.is_exception(cls):
        return False
    if cls.is_dataclass:
        return True
    if index.constructor(cls) is None:
        return False
    return cls.module in MODULE_ORDER or len(index.public_paths(cls)) > 1


def _is_reward_fn(fn: FunctionInfo) -> bool:
    return not fn.name.startswith("_") and any(n in fn.keyword_only for n in ("completions", "images"))


# ---------------------------------------------------------------------------------------------
# Markdown


def _md(text: str) -> str:
    """RST double backticks to Markdown, whitespace collapsed to single spaces."""
    return " ".join(re.sub(r"``(.+?)``", r"`\1`", text, flags=re.S).split())


def _cell(text: str) -> str:
    return _md(text).replace("|", "\\|")


def _code(text: str) -> str:
    text = " ".join(text.split())
    return f"`{text}`".replace("|", "\\|") if text else ""


def _table(rows: list[tuple[str, str, str, str]], head: str) -> list[str]:
    out = [f"| {head} | type | default | description |", "| --- | --- | --- | --- |"]
    out += [f"| {' | '.join(r)} |" for r in rows]
    return out


def _field_rows(cls: ClassInfo, fields: list[Param]) -> list[tuple[str, str, str, str]]:
    rows = []
    for f in fields:
        if f.name.startswith("_"):
            continue
        default = "*required*" if f.default is None else _code(f.default)
        if not f.init:
            default = f"{default} (not an argument)"
        doc = _cell(f.doc) if f.doc else "*(undocumented)*"
        if f.owner != cls.qualname:
            doc += f" *(from `{f.owner.rpartition('.')[2]}`)*"
        rows.append((f"`{f.name}`", _code(f.type), default, doc))
    return rows


def _arg_rows(owner: str, params: list[Param]) -> list[tuple[str, str, str, str]]:
    """Rows of constructor / factory arguments; ``owner`` is the qualified name of the callable's class."""
    rows = []
    for p in params:
        default = "*required*" if p.default is None else _code(p.default)
        doc = _cell(p.doc)
        if not doc and p.name in INJECTED:
            doc = f"*Injected:* {INJECTED[p.name]}; not set in a recipe."
        if p.owner != owner:  # forwarded through **kwargs to a base class
            doc = f"{doc} *(from `{p.owner.rpartition('.')[2]}`)*".strip()
        rows.append((f"`{p.name}`", _code(p.type), default, doc))
    return rows


def _class_section(index: PackageIndex, cls: ClassInfo) -> list[str]:
    paths = index.public_paths(cls)
    out = [f"### `{cls.name}`", ""]
    also = f" (also {', '.join(f'`{p}`' for p in paths[1:])})" if len(paths) > 1 else ""
    out += [f"`{paths[0]}`{also}", ""]
    if cls.doc:
        out += [_md(first_paragraph(cls.doc)), ""]
    bases = [b.rpartition(".")[2] for b in cls.bases if index.find_class(b) is not None]
    base_note = f" Subclass of {', '.join(f'`{b}`' for b in bases)}." if bases else ""
    factories = [(name, cls.classmethods[name]) for name in RECIPE_FACTORIES if name in cls.classmethods]
    shortest = min(paths, key=lambda p: (len(p), p))
    for name, fn in factories:
        out += [f"Built by `_target_: {shortest}.{name}`:", ""]
        out += _table(_arg_rows(f"{cls.qualname}.{name}", fn.params), "argument") + [""]
    if cls.is_dataclass:
        opts = cls.dataclass_options or {}
        flags = [w for w, on in (("keyword-only", opts.get("kw_only")), ("frozen", opts.get("frozen"))) if on]
        kind = f"Dataclass{' (' + ', '.join(flags) + ')' if flags else ''}.{base_note}"
        out += [f"{kind} Fields:" if not factories else f"{kind} Fields of the built object:", ""]
        out += _table(_field_rows(cls, index.dataclass_fields(cls)), "field") + [""]
    else:
        runs, params = index.constructor(cls)
        where = "" if runs is cls else f" (inherited from `{runs.name}`)"
        config = index.modules[cls.module].classes.get(f"{cls.name}Config")
        if config is not None and config.is_dataclass:  # e.g. TrainStack's arguments are TrainStackConfig's fields
            docs = {f.name: f.doc for f in index.dataclass_fields(config)}
            params = [p if p.doc else dataclasses.replace(p, doc=docs.get(p.name, "")) for p in params]
        out += [f"{base_note.strip()} Constructor arguments{where}:".strip(), ""]
        if params:
            out += _table(_arg_rows(runs.qualname, params), "argument") + [""]
        else:
            out += ["*(none)*", ""]
    return out


def _reward_fn_section(fn: FunctionInfo) -> list[str]:
    out = [f"### `{fn.name}`", "", f"`{fn.qualname}` (reward function)", ""]
    if fn.doc:
        out += [_md(first_paragraph(fn.doc)), ""]
    inputs = ", ".join(f"`{n}`" for n in REWARD_INPUTS if n in fn.keyword_only)
    receives = f"Receives {inputs}{' and every dataset column' if fn.var_keyword else ''}."
    extra = [p for p in fn.params if p.name not in REWARD_INPUTS]
    if not extra:
        return out + [receives, ""]
    out += [f"{receives} Its other keyword arguments (the source's `kwargs:`, or a dataset column of that name):", ""]
    rows = [(f"`{p.name}`", _code(p.type), "*required*" if p.default is None else _code(p.default), _cell(p.doc))
            for p in extra]
    return out + _table(rows, "argument") + [""]


def _header() -> list[str]:
    return [
        f"<!-- Generated by `{COMMAND}` from the source of unirl_ray. Do not edit by hand. -->",
        "",
        "# unirl_ray reference: recipe components and config schemas",
        "",
        "Every component a recipe builds by `_target_`, the trainers that run recipes, and every field of every",
        "config schema with its type, default and docstring, read from the source code. Regenerate it after",
        "changing a component, a field or a docstring (`tests/unit/test_reference_doc.py` fails while it is stale",
        "or while a config field has no docstring):",
        "",
        "```bash",
        f"{COMMAND}           # rewrites unirl_ray/README.md",
        f"{COMMAND} --check   # exit 1 when it is stale or a field is undocumented",
        "```",
        "",
        "Reading it: a recipe section's keys are the fields (dataclasses) or constructor arguments (other",
        "classes) of its `_target_`; nested `_target_` nodes are built first. *required* means there is no",
        "default. *Injected* arguments are passed by the trainer when it builds the worker sections. Types and",
        "defaults are shown as written in the source.",
        "",
    ]


def build_reference(package_dir: Path | str = PACKAGE_DIR, package: str = PACKAGE) -> Reference:
    """Generate the reference of the package at ``package_dir`` (deterministic: no paths, no dates)."""
    index = PackageIndex(package_dir, package)
    ref = Reference(text="")
    body: list[str] = []
    contents: list[str] = []
    for title, prefix, blurb in AREAS:
        entries: list[str] = []
        section = [f"## {title}", "", blurb, ""]
        for module_name in _area_modules(index, prefix):
            module = index.modules[module_name]
            for cls in module.classes.values():
                if not _is_component(index, cls):
                    continue
                section += _class_section(index, cls)
                entries.append(cls.name)
                ref.components.append(cls.qualname)
                if not cls.doc:
                    ref.undocumented_classes.append(f"{cls.path}:{cls.line} {cls.name}")
                if cls.is_dataclass:
                    for f in cls.fields:
                        if not f.doc and not f.name.startswith("_"):
                            ref.undocumented.append(f"{f.path}:{f.line} {cls.name}.{f.name}")
            if title == "rewards":
                for fn in module.functions.values():
                    if _is_reward_fn(fn):
                        section += _reward_fn_section(fn)
                        entries.append(fn.name)
                        ref.components.append(fn.qualname)
        if entries:
            body += section
            contents.append(f"- [{title}](#{title}): " + ", ".join(f"[`{e}`](#{e.lower()})" for e in entries))
    for module in index.modules.values():
        if any(_under(module.name, a[1]) for a in AREAS) or _under(module.name, NOT_COMPONENTS):
            continue
        for cls in module.classes.values():
            if cls.is_dataclass and not cls.name.startswith("_"):
                ref.uncovered.append(f"{cls.path}:{cls.line} {cls.name}")
    lines = _header() + ["## Contents", "", *contents, "", *body]
    ref.text = "\n".join(lines).rstrip() + "\n"
    return ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the file is stale")
    ap.add_argument("--output", default=str(OUTPUT), help="file to write or check (default: unirl_ray/README.md)")
    args = ap.parse_args(argv)
    ref = build_reference()
    out = Path(args.output)
    status = 0
    shown = f"{PACKAGE}/{OUTPUT.name}" if out.resolve() == OUTPUT else str(out)
    if args.check:
        current = out.read_text(encoding="utf-8") if out.is_file() else ""
        if current != ref.text:
            print(f"{shown} is stale: run `{COMMAND}`", file=sys.stderr)
            status = 1
    else:
        out.write_text(ref.text, encoding="utf-8")
        print(f"wrote {shown}: {len(ref.components)} components")
    problems = [
        ("config fields without a docstring (add one right under the field)", ref.undocumented),
        ("public dataclasses outside every documented area (add the package to AREAS or NOT_COMPONENTS)",
         ref.uncovered),
    ]
    for what, items in problems:
        if items:
            print(f"{len(items)} {what}:", *(f"  {i}" for i in items), sep="\n", file=sys.stderr)
            status = 1
    if ref.undocumented_classes:
        print(f"note: {len(ref.undocumented_classes)} components without a class docstring:",
              *(f"  {i}" for i in ref.undocumented_classes), sep="\n", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
