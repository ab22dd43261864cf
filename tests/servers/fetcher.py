"""An MCP server with one tool that fetches a URL, for the egress tests of sandboxed stdio servers.

It uses urllib as an ordinary client would, so it goes through $HTTP_PROXY when it is set; with no
proxy and no network its fetch fails, and the tool says how.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

mcp = MCPServer("fetcher")


@mcp.tool()
def fetch(url: str) -> str:
    """GET `url` and return its body, or the HTTP error's status and body."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise ToolError(f"HTTP {exc.code}: {exc.read().decode('utf-8', 'replace')}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ToolError(f"failed: {exc}") from None


@mcp.tool()
def proxy() -> str:
    """The proxy variables this server was started with."""
    return " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if "proxy" in k.lower())


if __name__ == "__main__":
    mcp.run()
