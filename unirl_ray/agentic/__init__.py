"""Pieces of the agentic trainer that need no Ray: tools a model may call, and the sandbox its code runs in.

- ``tool_calls``: Hermes / Qwen style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` parsing that
  survives malformed calls (the error is what goes back to the model as the observation);
- ``tools``: the calculator (AST-whitelisted arithmetic) and the sandboxed Python tool;
- ``sandbox``: ``PythonSandbox``, a child process with no network, a read-only filesystem but its scratch
  directory, no inherited environment, resource limits, killed and reported on timeout (Linux user namespaces).
"""

from unirl_ray.agentic.sandbox import PythonSandbox, SandboxLimits, SandboxResult, SandboxUnavailable
from unirl_ray.agentic.tool_calls import ToolCall, parse_tool_calls
from unirl_ray.agentic.tools import Calculator, PythonTool, ToolError

__all__ = ["Calculator", "PythonSandbox", "PythonTool", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "ToolCall", "ToolError", "parse_tool_calls"]
