"""The environment an agent talks to, and the default one: tools called the Hermes / Qwen way.

The contract users implement (one instance per trajectory; no Ray, no tokenizer needed)::

    env.reset(row) -> messages                                  # the conversation so far (system, user, ...)
    env.step(assistant_message) -> (observation, reward, done)  # messages back, a reward or None, whether it ended
    env.answer() -> str                                         # what the reward service scores at the end
    env.close()                                                 # (optional) the trajectory ended: free what it holds

``reward`` is a per-turn reward the environment knows itself (``None``: none); the terminal answer is scored
by the reward app(s). ``env.tools`` (JSON schemas) go to the chat template as ``tools=``; ``env.stats()``
reports what the trajectory did (tool calls, errors, seconds). An exception raised by ``step`` (a tool that
crashed, timed out, a broken environment) ends the trajectory as *failed*: it is excluded from the
advantages and counted, never trained on as if it had a reward.

``ToolEnvironment`` is the default: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the
assistant's message are parsed (``parse_tool_calls``); a malformed call, an unknown tool or a ``ToolError``
goes back to the model as the observation and is counted; each call has a wall-clock limit; tool responses
are cut to ``max_tool_response_tokens`` (``truncate_side``). A message without a tool call is the final one;
``max_turns`` assistant messages end the trajectory too. The answer is the content of the last
``<answer>...</answer>`` (``answer_source: tag``) or the whole last message (``last``).
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from abc import ABC, abstractmethod
from typing import Any, Literal, NamedTuple, Sequence

from unirl_ray.agentic.tool_calls import parse_tool_calls
from unirl_ray.agentic.tools import ToolError
from unirl_ray.agentic.transcript import TruncateSide, truncate_text
from unirl_ray.config.checks import check_literal_args


class EnvStep(NamedTuple):
    """What ``Environment.step`` returns."""

    observation: list[dict[str, Any]]
    """Messages for the model (tool results, a user turn); empty when the trajectory is done."""
    reward: float | None
    """A reward the environment gives this turn itself; ``None``: none (the terminal answer is scored by the service)."""
    done: bool
    """Whether the trajectory ended with this assistant message."""


class ToolFailure(RuntimeError):
    """A tool that crashed or ran out of time: the trajectory ends as failed, with this reason."""


class Environment(ABC):
    """Base class of agent environments (see the module docstring)."""

    tools: list[dict[str, Any]] = []
    """Tool schemas for the chat template's ``tools=`` (OpenAI function format)."""

    @abstractmethod
    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The first messages of a trajectory for a dataset row (``row["prompt"]`` and its other columns)."""

    @abstractmethod
    def step(self, assistant_message: str) -> EnvStep:
        """React to one assistant message; raise to end the trajectory as failed (the reason is kept)."""

    def answer(self) -> str:
        """The terminal answer the reward service scores (default: the last assistant message)."""
        return getattr(self, "_last_message", "")

    def stats(self) -> dict[str, float]:
        """What this trajectory did, summed over its turns (``tool_calls``, ``tool_errors``, ``tool_seconds``)."""
        return {}

    def close(self) -> None:
        """The trajectory ended (answered, failed or timed out): free what it held (processes, connections)."""


def tool_schema(tool: Any) -> dict[str, Any]:
    """The OpenAI function schema of a tool (``name``, ``description``, ``parameters``)."""
    return {"type": "function", "function": {"name": tool.name, "description": getattr(tool, "description", ""),
                                             "parameters": getattr(tool, "parameters", {"type": "object"})}}


_ANSWER = {}


def extract_tag(text: str, tag: str) -> str | None:
    """The content of the last ``<tag>...</tag>`` in ``text`` (stripped), or None."""
    pattern = _ANSWER.get(tag)
    if pattern is None:
        pattern = _ANSWER[tag] = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    found = pattern.findall(text)
    return found[-1].strip() if found else None


class ToolEnvironment(Environment):
    """Tools called with ``<tool_call>`` blocks; the last message without one is the answer (module docstring)."""

    def __init__(
        self,
        *,
        tools: Sequence[Any] = (),
        system_prompt: str | None = None,
        max_turns: int = 4,
        max_tool_response_tokens: int | None = 256,
        truncate_side: TruncateSide = "right",
        tool_timeout_s: float = 30.0,
        answer_source: Literal["tag", "last"] = "tag",
        answer_tag: str = "answer",
        tokenizer: Any = None,
    ) -> None:
        """
        Args:
            tools: Tool objects (``name``, ``description``, ``parameters``, ``__call__(**arguments) -> str``), e.g.
                ``unirl_ray.agentic.Calculator()``, and tool sets (a ``tools()`` method: ``MCPServerTools``, every
                tool of an MCP server); names must be unique.
            system_prompt: A system message before the user's prompt (``None``: none).
            max_turns: Assistant messages after which the trajectory ends, tool calls or not.
            max_tool_response_tokens: Longest tool response in tokens (``None``: no limit; needs ``tokenizer``).
            truncate_side: ``right`` keeps the head of a long response, ``left`` its tail.
            tool_timeout_s: Wall-clock limit of one tool call; a call over it fails the trajectory.
            answer_source: ``tag``: the content of the last ``<answer_tag>`` block ("" without one); ``last``: the
                last assistant message.
            tokenizer: Counts tokens for ``max_tool_response_tokens`` (the trainer passes the policy's).
        """
        check_literal_args(ToolEnvironment.__init__, "environment", locals())
        if max_turns < 1:
            raise ValueError(f"environment.max_turns must be >= 1, got {max_turns}")
        if tool_timeout_s <= 0:
            raise ValueError(f"environment.tool_timeout_s must be > 0, got {tool_timeout_s}")
        if max_tool_response_tokens is not None and max_tool_response_tokens < 1:
            raise ValueError(f"environment.max_tool_response_tokens must be >= 1 or null, got {max_tool_response_tokens}")
        tools = [t for item in tools for t in (item.tools() if callable(getattr(item, "tools", None)) else [item])]
        # a tool with state per trajectory (the Python tool's process) gives this trajectory its own copy
        own = [t.for_trajectory() if callable(getattr(t, "for_trajectory", None)) else t for t in tools]
        self._owned = [o for o, t in zip(own, tools) if o is not t]
        tools = own
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"environment.tools has duplicate names: {names}")
        self.by_name = {t.name: t for t in tools}
        self.tools = [tool_schema(t) for t in tools]
        self.system_prompt, self.max_turns = system_prompt, max_turns
        self.max_tool_response_tokens, self.truncate_side = max_tool_response_tokens, truncate_side
        self.tool_timeout_s, self.answer_source, self.answer_tag = tool_timeout_s, answer_source, answer_tag
        self.tokenizer = tokenizer
        self.turns = 0
        self.finish_reason: str | None = None
        """How the trajectory ended: ``answer`` (a message without a tool call) or ``max_turns``."""
        self._last_message = ""
        self._stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_seconds": 0.0, "tool_truncated": 0.0}

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": str(row["prompt"])}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, assistant_message: str) -> EnvStep:
        self.turns += 1
        self._last_message = assistant_message
        calls = parse_tool_calls(assistant_message)
        if not calls or self.turns >= self.max_turns:
            self.finish_reason = "max_turns" if calls else "answer"
            return EnvStep([], None, True)
        return EnvStep([self._respond(call) for call in calls], None, False)

    def _respond(self, call: Any) -> dict[str, Any]:
        self._stats["tool_calls"] += 1
        if call.error is None and call.name not in self.by_name:
            call.error = f"unknown tool {call.name!r}; the tools are: {', '.join(self.by_name) or 'none'}"
        if call.error is not None:
            self._stats["tool_errors"] += 1
            content = f"error: {call.error}"
        else:
            content = self._run(call)
        if self.max_tool_response_tokens is not None and self.tokenizer is not None:
            content, cut = truncate_text(self.tokenizer, content, self.max_tool_response_tokens, self.truncate_side)
            self._stats["tool_truncated"] += float(cut)
        return {"role": "tool", "name": call.name or "", "content": content}

    def _run(self, call: Any) -> str:
        """One tool call under ``tool_timeout_s``: a ``ToolError`` is the model's to read; anything else (a crash,
        the time limit) fails the trajectory. A call past its limit is abandoned on its thread (the shipped tools
        end by themselves: the sandbox kills its process at its own wall-time limit)."""
        tool = self.by_name[call.name]
        t0 = time.perf_counter()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tool-{call.name}")
        future = pool.submit(tool, **call.arguments)
        try:
            return str(future.result(timeout=self.tool_timeout_s))
        except ToolError as exc:
            self._stats["tool_errors"] += 1
            return f"error: {exc}"
        except TimeoutError as exc:
            if future.done():  # the tool's own time limit (an MCP call, a remote service)
                raise ToolFailure(f"tool {call.name!r} timed out: {exc}") from None
            raise ToolFailure(f"tool {call.name!r} did not answer within tool_timeout_s={self.tool_timeout_s:g}s") from None
        except Exception as exc:  # noqa: BLE001 - a crashed tool fails its trajectory, with the cause
            raise ToolFailure(f"tool {call.name!r} crashed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._stats["tool_seconds"] += time.perf_counter() - t0
            pool.shutdown(wait=False)

    def answer(self) -> str:
        if self.answer_source == "last":
            return self._last_message
        return extract_tag(self._last_message, self.answer_tag) or ""

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def close(self) -> None:
        for tool in self._owned:
            if callable(getattr(tool, "close", None)):
                tool.close()
