"""A stdio MCP server for the tests: ``add`` answers, ``hang`` never does, ``crash`` kills the server, ``env``
shows what the server process inherited, ``fail`` reports a tool error."""

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("unirl-test-tools")


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


@server.tool(description="Never answers.")
def hang() -> str:
    time.sleep(3600)
    return "late"


@server.tool(description="Kills the server process.")
def crash() -> str:
    os._exit(3)


@server.tool(description="The names of the environment variables the server sees.")
def env() -> str:
    return ",".join(sorted(os.environ))


@server.tool(description="Reports an error.")
def fail() -> str:
    raise ValueError("this tool always fails")


if __name__ == "__main__":
    sys.exit(server.run())
