"""An MCP server over HTTP (the official SDK: streamable HTTP, or the older HTTP+SSE with `--sse`) that
answers only requests carrying `X-Test-Token: <token>`; everything else gets 401. It binds a free port
on 127.0.0.1, listens, then prints the port on stdout: a test reads that line and connects, no waiting.

Usage: python headed_http.py TOKEN [--sse]
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

mcp = MCPServer("headed")


@mcp.tool()
def whisper(text: str) -> str:
    """Return the text in lower case."""
    return text.lower()


def _guarded(app: Any, token: str) -> Any:
    async def guard(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (b"x-test-token", token.encode()) not in scope["headers"]:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": "missing or wrong X-Test-Token"}'})
            return
        await app(scope, receive, send)

    return guard


async def main(token: str, sse: bool) -> None:
    security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    app = mcp.sse_app(transport_security=security) if sse else mcp.streamable_http_app(transport_security=security)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(_guarded(app, token), log_level="warning", lifespan="on")
    await uvicorn.Server(config).serve(sockets=[sock])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "--sse" in sys.argv[2:]))
