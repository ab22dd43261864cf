"""The MCP server both sides of bench.mcp_stdio call: one trivial tool, so transport cost dominates."""

from mcp.server.mcpserver import MCPServer

mcp = MCPServer("bench-echo")


@mcp.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


if __name__ == "__main__":
    mcp.run("stdio")
