"""An MCP server (stdio, the official SDK) whose tools answer with as many megabytes as asked for.

The device must refuse a result over its size cap quickly and without stalling: the SDK's own stdio
reader re-joins a long line chunk by chunk (quadratic), which held a device at 99% CPU for 100 s on a
50 MB answer.
"""

from __future__ import annotations

import os

import mcp_types
from mcp.server.mcpserver import MCPServer

mcp = MCPServer("bulky")


@mcp.tool()
def big(megabytes: float) -> mcp_types.CallToolResult:
    """A text result of `megabytes` MB (10^6 bytes)."""
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text="x" * int(megabytes * 1e6))])


@mcp.tool()
def big_structured(megabytes: float) -> dict[str, str]:
    """Structured output of about `megabytes` MB."""
    return {"data": "y" * int(megabytes * 1e6)}


@mcp.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@mcp.tool()
def pid() -> int:
    """The server's process id, to tell a restarted server from the old one."""
    return os.getpid()


if __name__ == "__main__":
    mcp.run()
