"""An MCP server (stdio, the official SDK) that starts serving only when the test says so: it first
reads one line from the FIFO named by `--gate`. A test sees a device register, list and run tools
while this server is provably not ready, then opens the gate."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer

mcp = MCPServer("gated")


@mcp.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@mcp.tool()
def read_file(file_path: str) -> str:
    """A name the built-in files tool set also has: the built-in one keeps the plain name."""
    return f"gated would read {file_path}"


if __name__ == "__main__":
    with open(sys.argv[sys.argv.index("--gate") + 1]) as gate:  # blocks until the test opens it to write
        gate.readline()
    mcp.run("stdio")
