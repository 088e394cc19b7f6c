"""Tools of any MCP server, for ``ToolEnvironment``: ``MCPServerTools(command=[...])`` (stdio) or ``(url=...)``
(streamable HTTP), listed under ``environment.tools`` like any other tool.

``MCPServerTools`` is a tool *set*: ``ToolEnvironment`` expands it into one tool per server tool (its name,
description and input schema, as the server lists them; ``include`` keeps a subset). One connection per
server and process is shared by every trajectory's environment: it lives on a background thread with its
own asyncio loop (the official ``mcp`` client, ``mcp.Client``), calls from many trajectories' tool threads
go through it at once, each bounded by ``timeout_s`` (and by the environment's ``tool_timeout_s``).

A result the server marks as an error (``is_error``) is a ``ToolError``: its text goes back to the model. A
call that times out, or a server that crashed (its connection closed), raises: the environment fails that
trajectory with the reason, and the next call starts a fresh connection (a stdio server is started again).

The server is a process you name: it is not run in the Python tool's sandbox. A stdio server inherits only
``mcp``'s default environment (``HOME``, ``PATH``, ...) plus ``env``: none of the trainer's variables.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Sequence

from unirl_ray.agentic.tools import ToolError

_CONNECTIONS: dict[tuple, "_Connection"] = {}
_LOCK = threading.Lock()


class _Connection:
    """One open MCP client session on a background event loop."""

    def __init__(self, server: Any, timeout_s: float, startup_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self.thread.start()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._closing = asyncio.Event()
        self.closed = False
        self._task = asyncio.run_coroutine_threadsafe(self._hold(server), self.loop)
        try:
            self.client, self.tools = self._ready.result(timeout=startup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise RuntimeError(f"the MCP server {server!r} did not start within {startup_timeout_s:g}s") from None
        except BaseException:
            self.close()
            raise

    async def _hold(self, server: Any) -> None:
        from mcp import Client

        try:
            # a tool call's own deadline (``call``) reports a hung tool; the client's read timeout is only a
            # backstop, later, so that the two never race (under load the client's used to win and its error
            # read as a crashed tool)
            async with Client(server, read_timeout_seconds=self.timeout_s + 30.0) as client:
                listed = await client.list_tools()
                self._ready.set_result((client, list(listed.tools)))
                await self._closing.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting caller, or marks the connection dead
            if not self._ready.done():
                self._ready.set_exception(exc)
        finally:
            self.closed = True

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        if self.closed:
            raise RuntimeError("the MCP server's connection is closed (the server exited)")
        future = asyncio.run_coroutine_threadsafe(self.client.call_tool(name, arguments), self.loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"MCP tool {name!r} did not answer within {timeout_s:g}s") from None

    def close(self) -> None:
        self.closed = True
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self._closing.set)
            try:
                self._task.result(timeout=10)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)


class MCPTool:
    """One tool of an MCP server (built by ``MCPServerTools``)."""

    def __init__(self, toolset: "MCPServerTools", name: str, description: str, parameters: dict[str, Any]) -> None:
        self.toolset, self.name, self.description, self.parameters = toolset, name, description, parameters

    def __call__(self, **arguments: Any) -> str:
        result = self.toolset.call(self.name, arguments)
        text = "\n".join(getattr(block, "text", "") or str(block) for block in (result.content or []))
        if getattr(result, "is_error", False):
            raise ToolError(text or f"the MCP tool {self.name!r} reported an error")
        return text


class MCPServerTools:
    """The tools of one MCP server (see the module docstring)."""

    def __init__(self, *, command: Sequence[str] | None = None, url: str | None = None,
                 env: dict[str, str] | None = None, include: Sequence[str] | None = None,
                 timeout_s: float = 30.0, startup_timeout_s: float = 60.0) -> None:
        """
        Args:
            command: A stdio server: the command and its arguments (e.g. ``[python, my_server.py]``).
            url: A streamable-HTTP server's URL (e.g. ``http://127.0.0.1:8000/mcp``); exactly one of the two.
            env: Extra environment variables of a stdio server (nothing of the trainer's is passed on).
            include: The server's tools to offer the model (default: all it lists).
            timeout_s: Longest wait for one call.
            startup_timeout_s: Longest wait for the server to start and list its tools.
        """
        if (command is None) == (url is None):
            raise ValueError("MCPServerTools needs exactly one of command= (a stdio server) and url= (HTTP)")
        if command is not None and (isinstance(command, str) or not command):
            raise ValueError(f"MCPServerTools.command must be a non-empty list [program, arg, ...], got {command!r}")
        if timeout_s <= 0 or startup_timeout_s <= 0:
            raise ValueError("MCPServerTools.timeout_s and startup_timeout_s must be > 0")
        self.command, self.url, self.env = list(command) if command else None, url, dict(env or {})
        self.include, self.timeout_s, self.startup_timeout_s = list(include) if include else None, timeout_s, startup_timeout_s
        self._key = (tuple(self.command or ()), url, tuple(sorted(self.env.items())))

    def _server(self) -> Any:
        if self.url is not None:
            return self.url
        from mcp import StdioServerParameters
        from mcp.client.stdio import get_default_environment

        return StdioServerParameters(command=self.command[0], args=self.command[1:],
                                     env={**get_default_environment(), **self.env})

    def _connection(self) -> _Connection:
        with _LOCK:
            conn = _CONNECTIONS.get(self._key)
            if conn is None or conn.closed:
                conn = _CONNECTIONS[self._key] = _Connection(self._server(), self.timeout_s, self.startup_timeout_s)
            return conn

    def tools(self) -> list[MCPTool]:
        """One ``MCPTool`` per tool the server lists (``include``: those named, in that order)."""
        listed = {t.name: t for t in self._connection().tools}
        names = self.include or list(listed)
        missing = [n for n in names if n not in listed]
        if missing:
            raise ValueError(f"the MCP server has no tools {missing}; it lists {sorted(listed)}")
        return [MCPTool(self, n, listed[n].description or "", dict(listed[n].input_schema or {"type": "object"}))
                for n in names]

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        return self._connection().call(name, arguments, self.timeout_s)


def close_all() -> None:
    """Close every MCP connection of this process (stdio servers exit)."""
    with _LOCK:
        conns = list(_CONNECTIONS.values())
        _CONNECTIONS.clear()
    for conn in conns:
        conn.close()
