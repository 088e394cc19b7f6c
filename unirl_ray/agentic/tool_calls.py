"""Hermes / Qwen style tool calls in an assistant message: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

``parse_tool_calls`` never raises on what a model wrote: every ``<tool_call>`` block becomes a ``ToolCall``,
and a malformed one (not JSON, no ``name``, ``arguments`` not an object, an unclosed tag) carries an
``error`` instead, which the environment sends back to the model as the observation (and counts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(kw_only=True)
class ToolCall:
    """One tool call of an assistant message."""

    name: str | None
    """The tool named (None when the call is malformed)."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Its keyword arguments."""
    raw: str = ""
    """The text between the tags, as written."""
    error: str | None = None
    """Why the call cannot run (sent back to the model); None for a well-formed call."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text``, in order (see the module docstring)."""
    calls = []
    for match in _BLOCK.finditer(text):
        raw = match.group(1).strip()
        closed = match.group(0).endswith(CLOSE)
        if not closed:
            calls.append(ToolCall(name=None, raw=raw, error=f"unclosed {OPEN}: end the call with {CLOSE}"))
            continue
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(name=None, raw=raw, error=f"the tool call is not valid JSON ({exc.msg} at "
                                                            f"character {exc.pos}); write {{\"name\": ..., \"arguments\": {{...}}}}"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
            calls.append(ToolCall(name=None, raw=raw, error='the tool call needs a "name" (a string)'))
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(name=payload["name"], raw=raw, error='"arguments" must be an object'))
            continue
        calls.append(ToolCall(name=payload["name"], arguments=arguments, raw=raw))
    return calls
