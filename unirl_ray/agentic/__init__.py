"""Pieces of the agentic trainer that need no Ray: token-in/token-out transcripts, tools a model may call, and
the sandbox its code runs in.

- ``transcript``: ``TokenTranscript``, a multi-turn trajectory kept as the exact ids sampled (mask 1) and the
  template's rendering of each observation alone (mask 0), with a strict re-render check;
- ``tool_calls``: Hermes / Qwen style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` parsing that
  survives malformed calls (the error is what goes back to the model as the observation);
- ``tools``: the calculator (AST-whitelisted arithmetic) and the sandboxed Python tool;
- ``environment``: the contract an environment implements (``reset(row) -> messages``, ``step(message) ->
  (observation, reward, done)``, ``answer()``) and ``ToolEnvironment``, the default: tools called with
  ``<tool_call>`` blocks, per-call time limits, truncated responses, the answer from an ``<answer>`` tag;
- ``mcp``: ``MCPServerTools``, the tools of any MCP server (stdio or HTTP) as tools of ``ToolEnvironment``;
- ``sandbox``: ``PythonSandbox``, a child process with no network, a read-only filesystem but its scratch
  directory, no inherited environment, resource limits, killed and reported on timeout (Linux user namespaces);
  ``PythonSession``, one such process that keeps its state from run to run (the Python tool's, per trajectory).
"""

from unirl_ray.agentic.environment import EnvStep, Environment, ToolEnvironment, ToolFailure
from unirl_ray.agentic.mcp import MCPServerTools, MCPTool
from unirl_ray.agentic.sandbox import PythonSandbox, PythonSession, SandboxLimits, SandboxResult, SandboxUnavailable
from unirl_ray.agentic.tool_calls import ToolCall, parse_tool_calls
from unirl_ray.agentic.tools import Calculator, PythonTool, ToolError
from unirl_ray.agentic.transcript import TokenTranscript, TurnSpan, render_ids, truncate_text

__all__ = ["Calculator", "EnvStep", "Environment", "MCPServerTools", "MCPTool", "PythonSandbox", "PythonSession", "PythonTool", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "TokenTranscript", "ToolCall", "ToolEnvironment", "ToolError", "ToolFailure", "TurnSpan", "parse_tool_calls", "render_ids", "truncate_text"]
