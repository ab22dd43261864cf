"""A deliberately fragile MCP server for the MCP server tests (stdio by default, `--http-fd FD`: HTTP on that socket).

Each tool exercises one path of the device's MCP client: plain text, structured output, a tool
error, a process that dies mid-call, a call that outlives its timeout, and request headers.
"""

from __future__ import annotations

import os
import sys

import anyio
import mcp_types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel

mcp = MCPServer("crashy")


class Sum(BaseModel):
    total: int


@mcp.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@mcp.tool()
def add(a: int, b: int) -> Sum:
    """Add two integers (structured output)."""
    return Sum(total=a + b)


@mcp.tool()
def fail() -> str:
    """Always fails with a tool error."""
    raise ToolError("this tool always fails")


@mcp.tool()
async def crash() -> str:
    """Kill the whole server process in the middle of the call."""
    os._exit(3)


@mcp.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await anyio.sleep(seconds)
    return f"slept {seconds}"


@mcp.tool()
def both() -> mcp_types.CallToolResult:
    """Text and structured content that differ: the client must prefer the structured one."""
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text="a summary for people")],
                                    structured_content={"machine": True})


@mcp.tool()
def text_only(text: str) -> mcp_types.CallToolResult:
    """The text as the only content, no structured output (like servers that predate it)."""
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)])


@mcp.tool()
def image() -> mcp_types.CallToolResult:
    """A one-pixel PNG as image content."""
    data = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII=")
    return mcp_types.CallToolResult(content=[mcp_types.ImageContent(type="image", data=data,
                                                                    mime_type="image/png")])


@mcp.tool()
def header(name: str, ctx: Context) -> str:
    """The value of one request header as the server saw it ('' on stdio)."""
    return (ctx.headers or {}).get(name.lower(), "")


@mcp.tool()
def pid() -> int:
    """The server's process id, to tell a restarted server from the old one."""
    return os.getpid()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http-fd":  # a listening socket the parent made and passed
        import functools
        import socket

        from tether.tools.toolsets.mcp_export import serve_http

        anyio.run(functools.partial(serve_http, mcp, sock=socket.socket(fileno=int(sys.argv[2]))))
    else:
        mcp.run()
