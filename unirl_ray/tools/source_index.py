"""Classes, dataclass fields, constructor arguments and docstrings of a package, read with ``ast``.

Nothing is imported, so the reference can be generated without torch, Ray or optional extras, and
it shows what the source says: annotations and defaults as written (module-level ``Literal``
aliases expanded), the field docstring placed right under each dataclass field, ``Args:`` entries
of a constructor's docstring.
"""

from __future__ import annotations

import ast
import copy
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:")
_EXCEPTION_ROOTS = ("Exception", "BaseException")


@dataclass(frozen=True, kw_only=True)
class Param:
    """One dataclass field or one constructor / function argument."""

    name: str
    """Field or argument name."""
    type: str
    """Annotation as written ('' when unannotated), module-level ``Literal`` aliases expanded."""
    default: str | None
    """Default as source text; ``None`` when there is none (required)."""
    doc: str
    """Field docstring, or the argument's ``Args:`` entry; '' when there is none."""
    owner: str
    """Qualified name of the class (or function) that declares it."""
    path: str
    """Source file relative to the package's parent folder, e.g. ``unirl_ray/train/configs.py``."""
    line: int
    """Line of the declaration."""
    init: bool = True
    """False for ``field(init=False)``: not a constructor argument."""


@dataclass(kw_only=True)
class FunctionInfo:
    """A top-level function."""

    module: str
    """Dotted module name."""
    name: str
    """Function name."""
    path: str
    """Source file relative to the package's parent folder."""
    line: int
    """Line of the ``def``."""
    doc: str
    """Cleaned docstring ('' when there is none)."""
    params: list[Param]
    """Named parameters in order (``*args`` / ``**kwargs`` left out)."""
    keyword_only: tuple[str, ...]
    """Names of the keyword-only parameters."""
    var_keyword: bool
    """Whether it takes ``**kwargs``."""

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(kw_only=True)
class ClassInfo:
    """A top-level class."""

    module: str
    """Dotted module name."""
    name: str
    """Class name."""
    path: str
    """Source file relative to the package's parent folder."""
    line: int
    """Line of the ``class`` statement."""
    doc: str
    """Cleaned docstring ('' when there is none)."""
    bases: tuple[str, ...]
    """Base classes: qualified names inside the package, source text otherwise."""
    dataclass_options: dict[str, object] | None
    """Keyword options of the ``@dataclass`` decorator (``kw_only``, ``frozen``); None: not a dataclass."""
    fields: list[Param] = field(default_factory=list)
    """Own dataclass fields in declaration order (ClassVar and ``KW_ONLY`` markers left out)."""
    init: FunctionInfo | None = None
    """Own ``__init__`` (parameters without ``self``); None when the class does not define one."""
    classmethods: dict[str, FunctionInfo] = field(default_factory=dict)
    """Own classmethods by name (parameters without ``cls``)."""

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def is_dataclass(self) -> bool:
        return self.dataclass_options is not None


@dataclass(kw_only=True)
class ModuleInfo:
    """One parsed source file."""

    name: str
    """Dotted module name (a package's ``__init__`` has the package's name)."""
    path: str
    """Source file relative to the package's parent folder."""
    is_package: bool
    """True for an ``__init__.py``."""
    imports: dict[str, str]
    """Local name -> qualified name it was imported as (also a lazy ``_EXPORTS`` table's names)."""
    aliases: dict[str, ast.expr]
    """Module-level ``Name = Literal[...]`` aliases."""
    classes: dict[str, ClassInfo]
    """Top-level classes by name, in source order."""
    functions: dict[str, FunctionInfo]
    """Top-level functions by name, in source order."""


# ---------------------------------------------------------------------------------------------
# text helpers


def first_paragraph(doc: str) -> str:
    """The docstring up to its first blank line, on one line."""
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


def args_section(doc: str) -> dict[str, str]:
    """``{name: text}`` of a Google-style ``Args:`` section (continuation lines joined)."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in _ARGS_HEADERS), None)
    if start is None:
        return out
    indent, current = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            break
        match = re.match(r"\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line.strip())
        if width == indent and match:
            current = match.group(1)
            out[current] = match.group(2).strip()
        elif current is not None:
            out[current] = f"{out[current]} {line.strip()}".strip()
    return out


# ---------------------------------------------------------------------------------------------
# parsing one module


class _ExpandAliases(ast.NodeTransformer):
    def __init__(self, aliases: dict[str, ast.expr]) -> None:
        self.aliases = aliases

    def visit_Name(self, node: ast.Name) -> ast.AST:
        value = self.aliases.get(node.id)
        return copy.deepcopy(value) if value is not None else node


def _docstring(body: list[ast.stmt]) -> str:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        value = body[0].value.value
        if isinstance(value, str):
            return inspect.cleandoc(value)
    return ""


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return ""


def _constant_kwargs(call: ast.expr) -> dict[str, object]:
    if not isinstance(call, ast.Call):
        return {}
    return {k.arg: k.value.value for k in call.keywords if k.arg and isinstance(k.value, ast.Constant)}


class _ModuleParser:
    def __init__(self, name: str, path: str, tree: ast.Module, is_package: bool) -> None:
        self.name, self.path, self.tree, self.is_package = name, path, tree, is_package
        self.aliases: dict[str, ast.expr] = {}
        self.imports: dict[str, str] = {}

    def collect_names(self) -> None:
        """First pass: imports and ``Literal`` aliases (aliases imported from other modules are added later)."""
        for node in self._top_level(self.tree.body):
            self._collect_import(node)
            self._collect_alias(node)

    def parse(self) -> ModuleInfo:
        classes: dict[str, ClassInfo] = {}
        functions: dict[str, FunctionInfo] = {}
        for node in self.tree.body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = self._class(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[node.name] = self._function(node, owner=f"{self.name}.{node.name}")
        return ModuleInfo(name=self.name, path=self.path, is_package=self.is_package, imports=self.imports,
                          aliases=self.aliases, classes=classes, functions=functions)

    @staticmethod
    def _top_level(body: list[ast.stmt]):
        for node in body:  # imports under ``if TYPE_CHECKING:`` / ``try:`` count too
            yield node
            if isinstance(node, ast.If):
                yield from _ModuleParser._top_level(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from _ModuleParser._top_level(node.body + node.orelse + node.finalbody)

    def _package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]

    def _collect_import(self, node: ast.stmt) -> None:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = self._package().split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                self.imports[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    self.imports[alias.asname] = alias.name
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id == "_EXPORTS" and isinstance(node.value, ast.Dict)):
            for key, value in zip(node.value.keys, node.value.values):  # lazy re-exports: {"Name": "submodule"}
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                    self.imports[str(key.value)] = f"{self.name}.{value.value}.{key.value}"

    def _collect_alias(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Subscript) and _decorator_name(value.value) == "Literal":
                self.aliases[node.targets[0].id] = value

    def _annotation(self, node: ast.expr | None) -> str:
        """An annotation as text (a quoted one unquoted), ``Literal`` aliases of this module expanded."""
        if node is None:
            return ""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return node.value
        return ast.unparse(_ExpandAliases(self.aliases).visit(copy.deepcopy(node)))

    @staticmethod
    def _value(node: ast.expr) -> str:
        return ast.unparse(node)

    def _class(self, node: ast.ClassDef) -> ClassInfo:
        options = None
        for deco in node.decorator_list:
            if _decorator_name(deco) == "dataclass":
                options = _constant_kwargs(deco)
        info = ClassInfo(module=self.name, name=node.name, path=self.path, line=node.lineno,
                         doc=_docstring(node.body), bases=tuple(ast.unparse(b) for b in node.bases),
                         dataclass_options=options)
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and options is not None:
                annotation = self._annotation(stmt.annotation)
                if annotation.split("[")[0].split(".")[-1] in ("ClassVar", "KW_ONLY"):
                    continue
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = _docstring([nxt]) if nxt is not None else ""
                default, init = self._field_default(stmt.value)
                info.fields.append(Param(name=stmt.target.id, type=annotation, default=default, doc=doc,
                                         owner=info.qualname, path=self.path, line=stmt.lineno, init=init))
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = {_decorator_name(d) for d in stmt.decorator_list}
                if stmt.name == "__init__":
                    info.init = self._function(stmt, owner=info.qualname, skip_first=True, class_doc=info.doc)
                elif "classmethod" in decorators:
                    info.classmethods[stmt.name] = self._function(stmt, owner=f"{info.qualname}.{stmt.name}",
                                                                  skip_first=True)
        return info

    def _field_default(self, value: ast.expr | None) -> tuple[str | None, bool]:
        """(default as text or None, whether the field is an ``__init__`` argument)."""
        if value is None:
            return None, True
        if isinstance(value, ast.Call) and _decorator_name(value) == "field":
            kwargs = {k.arg: k.value for k in value.keywords if k.arg}
            init = not (isinstance(kwargs.get("init"), ast.Constant) and kwargs["init"].value is False)
            if "default" in kwargs:
                return self._value(kwargs["default"]), init
            factory = kwargs.get("default_factory")
            if isinstance(factory, ast.Lambda):
                return self._value(factory.body), init
            if isinstance(factory, ast.Name) and factory.id in ("list", "dict", "set", "tuple"):
                return {"list": "[]", "dict": "{}", "set": "set()", "tuple": "()"}[factory.id], init
            if factory is not None:
                return f"{self._value(factory)}()", init
            return None, init
        return self._value(value), True

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, *, owner: str, skip_first: bool = False,
                  class_doc: str = "") -> FunctionInfo:
        doc = _docstring(node.body)
        arg_docs = {**args_section(class_doc), **args_section(doc)}
        a = node.args
        positional = a.posonlyargs + a.args
        if skip_first and positional:
            positional = positional[1:]
        pos_defaults = [None] * (len(a.posonlyargs + a.args) - len(a.defaults)) + list(a.defaults)
        if skip_first and pos_defaults:
            pos_defaults = pos_defaults[1:]
        params = [self._param(arg, default, owner, arg_docs) for arg, default in zip(positional, pos_defaults)]
        params += [self._param(arg, default, owner, arg_docs) for arg, default in zip(a.kwonlyargs, a.kw_defaults)]
        return FunctionInfo(module=self.name, name=node.name, path=self.path, line=node.lineno, doc=doc,
                            params=params, keyword_only=tuple(arg.arg for arg in a.kwonlyargs),
                            var_keyword=a.kwarg is not None)

    def _param(self, arg: ast.arg, default: ast.expr | None, owner: str, docs: dict[str, str]) -> Param:
        return Param(name=arg.arg, type=self._annotation(arg.annotation),
                     default=None if default is None else self._value(default), doc=docs.get(arg.arg, ""),
                     owner=owner, path=self.path, line=arg.lineno)


# ---------------------------------------------------------------------------------------------
# the package


class PackageIndex:
    """Every module of one package, parsed; resolves names across modules and re-exports."""

    def __init__(self, package_dir: Path | str, package: str | None = None) -> None:
        root = Path(package_dir)
        self.package = package or root.name
        self.modules: dict[str, ModuleInfo] = {}
        parsers: dict[str, _ModuleParser] = {}
        for file in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
            rel = file.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            parts = [self.package, *rel.with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            path = "/".join([self.package, *rel.parts])
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=path)
            parsers[name] = _ModuleParser(name, path, tree, is_package)
            parsers[name].collect_names()
        for parser in parsers.values():  # ``from pkg.mod import SomeLiteral`` expands like a local alias
            for local, target in parser.imports.items():
                module, _, attr = target.rpartition(".")
                alias = parsers[module].aliases.get(attr) if module in parsers else None
                if alias is not None and local not in parser.aliases:
                    parser.aliases[local] = alias
        for name, parser in parsers.items():
            self.modules[name] = parser.parse()
        for module in self.modules.values():  # resolve base classes now that every module is known
            for cls in module.classes.values():
                cls.bases = tuple(self._resolve_base(module, b) for b in cls.bases)

    # ----------------------------------------------------------------- lookups
    def find_class(self, qualname: str, _depth: int = 0) -> ClassInfo | None:
        """The class a qualified name points to, through re-exports; None outside the package."""
        if _depth > 8:
            return None
        module_name, _, attr = qualname.rpartition(".")
        module = self.modules.get(module_name)
        if module is None:
            return None
        if attr in module.classes:
            return module.classes[attr]
        if attr in module.imports:
            return self.find_class(module.imports[attr], _depth + 1)
        return None

    def _resolve_base(self, module: ModuleInfo, text: str) -> str:
        head, _, rest = text.partition(".")
        if not rest and head in module.classes:
            return f"{module.name}.{head}"
        target = module.imports.get(head)
        if target is None:
            return text
        qual = f"{target}.{rest}" if rest else target
        found = self.find_class(qual)
        return found.qualname if found else qual

    def lineage(self, cls: ClassInfo) -> list[ClassInfo]:
        """The class and its package bases, depth-first left to right, each once (an MRO stand-in)."""
        out: list[ClassInfo] = []

        def visit(c: ClassInfo) -> None:
            if any(c is seen for seen in out):
                return
            out.append(c)
            for base in c.bases:
                found = self.find_class(base)
                if found is not None:
                    visit(found)

        visit(cls)
        return out

    def is_exception(self, cls: ClassInfo) -> bool:
        for c in self.lineage(cls):
            for base in c.bases:
                short = base.rpartition(".")[2]
                if short in _EXCEPTION_ROOTS or short.endswith(("Error", "Warning")):
                    return True
        return False

    def dataclass_fields(self, cls: ClassInfo) -> list[Param]:
        """Every field of a dataclass, inherited ones first (an overriding field keeps its place)."""
        fields: dict[str, Param] = {}
        for c in reversed(self.lineage(cls)):
            if c.is_dataclass:
                for f in c.fields:
                    fields[f.name] = f
        return list(fields.values())

    def constructor(self, cls: ClassInfo) -> tuple[ClassInfo, list[Param]] | None:
        """(class whose ``__init__`` runs, its arguments plus those it forwards with ``**kwargs``)."""
        chain = [c for c in self.lineage(cls) if c.init is not None]
        if not chain:
            return None
        params: list[Param] = []
        for c in chain:
            params += [p for p in c.init.params if all(p.name != q.name for q in params)]
            if not c.init.var_keyword:
                break
        return chain[0], params

    def public_paths(self, cls: ClassInfo) -> list[str]:
        """Import paths of a class: where it is defined first, then the packages that re-export it."""
        paths = [cls.qualname]
        for module in self.modules.values():
            if not module.is_package:
                continue
            for local, target in module.imports.items():
                if local.startswith("_"):
                    continue
                if self.find_class(target) is cls and f"{module.name}.{local}" not in paths:
                    paths.append(f"{module.name}.{local}")
        return paths[:1] + sorted(paths[1:], key=lambda p: (len(p), p))
