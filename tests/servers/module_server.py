"""An MCP server a device loads in-process from its `mcp` attribute (`server_type: local, module: ...`)."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

mcp = MCPServer("module-server")
_calls = {"count": 0}


@mcp.tool()
def greet(name: str) -> str:
    """Say hello."""
    return f"hello, {name}"


@mcp.tool()
def count() -> int:
    """How many times this tool ran in this process: proves the session reuses one server object."""
    _calls["count"] += 1
    return _calls["count"]
