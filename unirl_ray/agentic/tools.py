"""Tools an agent may call: a calculator and sandboxed Python. A tool is ``name``, ``description``,
``parameters`` (a JSON schema for the chat template's ``tools=``) and ``__call__(**arguments) -> str``; it
raises ``ToolError`` with a message for the model when a call cannot be answered."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from unirl_ray.agentic.sandbox import PythonSandbox, PythonSession, SandboxLimits


class ToolError(ValueError):
    """A call the tool cannot answer; its message goes back to the model as the observation."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log,
              "exp": math.exp, "floor": math.floor, "ceil": math.ceil}
_CONSTANTS = {"pi": math.pi, "e": math.e}


class Calculator:
    """Arithmetic on numbers only: the expression's syntax tree is checked node by node against a whitelist
    (numbers, + - * / // % **, unary +/-, a few math functions and constants); nothing is ever ``eval``-ed."""

    name = "calculator"
    description = "Evaluate an arithmetic expression, e.g. (3 + 4) * 2 or sqrt(2) ** 2."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def __init__(self, *, max_chars: int = 200, max_exponent: int = 100) -> None:
        self.max_chars, self.max_exponent = max_chars, max_exponent

    def __call__(self, expression: Any = None, **unexpected: Any) -> str:
        if unexpected:
            raise ToolError(f"calculator takes only 'expression', got {', '.join(sorted(unexpected))}")
        if not isinstance(expression, str) or not expression.strip():
            raise ToolError("calculator needs 'expression': a non-empty string")
        if len(expression) > self.max_chars:
            raise ToolError(f"the expression is longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError as exc:
            raise ToolError(f"not an arithmetic expression ({exc.msg})") from None
        try:
            value = self._eval(tree.body)
        except (ZeroDivisionError, OverflowError, ValueError) as exc:
            raise ToolError(f"cannot compute it: {exc}") from None
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return str(value)

    def _eval(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ValueError(f"exponents above {self.max_exponent} are refused")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.Name) and node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return _FUNCTIONS[node.func.id](*(self._eval(a) for a in node.args))
        raise ToolError(f"only numbers, + - * / // % **, parentheses and {', '.join(_FUNCTIONS)} are allowed "
                        f"(found {type(node).__name__})")


class PythonTool:
    """Runs the model's Python code in the sandbox; the observation is what it printed (and how it ended when it
    did not end normally). With ``session`` (the default) each trajectory gets one sandboxed process that keeps
    its variables and files from call to call (``PythonSession``), started at its first call and killed when the
    trajectory ends; without it every call is a fresh process (``PythonSandbox.run``)."""

    name = "python"
    description = "Run a Python program and see what it prints. No network; only the working directory is writable."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, *, limits: SandboxLimits | dict[str, Any] | None = None, session: bool = True) -> None:
        self.sandbox = PythonSandbox(SandboxLimits(**limits) if isinstance(limits, dict) else limits)
        self.session = session
        self._session: PythonSession | None = None

    def for_trajectory(self) -> PythonTool:
        """This tool for one trajectory (``ToolEnvironment`` asks for it): with ``session``, a copy with a Python
        process of its own, so trajectories never see each other's variables even where they share a tool object."""
        if not self.session:
            return self
        tool = PythonTool(limits=self.sandbox.limits, session=True)
        tool._session = tool.sandbox.session()
        return tool

    def __call__(self, code: Any = None, **unexpected: Any) -> str:
        if unexpected:
            raise ToolError(f"python takes only 'code', got {', '.join(sorted(unexpected))}")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("python needs 'code': a non-empty string")
        if self.session and self._session is None:
            raise RuntimeError("a session PythonTool runs per trajectory: call for_trajectory() (ToolEnvironment does)")
        result = (self._session or self.sandbox).run(code)
        text = result.stdout
        if result.stderr.strip():
            text += ("\n" if text else "") + result.stderr
        if result.reason:
            text += ("\n" if text else "") + f"[{result.reason}]"
        return text.strip() or "(no output)"

    def close(self) -> None:
        """Kill this trajectory's Python process, if it has one."""
        if self._session is not None:
            self._session.close()
