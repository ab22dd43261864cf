"""The fleet as an MCP server: the gateway mounted at `/mcp` on the agent server.

The app factory mounts it; it imports nothing from `server/web`, `server/cluster` or `tether.agent`.
Layers above the server (the agent's task tools) add their tools through `contributed.py`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from starlette.applications import Starlette


def mount_gateway(app: Starlette) -> AbstractAsyncContextManager[None]:
    """Add `/mcp` to `app` (which has `state.hub`, `state.store`, `state.settings`) and return the context
    the app's lifespan enters: the SDK's session manager runs inside it. The `mcp` SDK is imported here,
    not when the server package is."""
    from starlette.routing import Route

    from tether.server.mcp.contributed import contribute
    from tether.server.mcp.fanout_tool import fan_out_tool
    from tether.server.mcp.gateway import Gateway

    contribute(app, [fan_out_tool(app.state.hub)])  # the fleet's own fan-out, beside the agent's task tools
    gateway = Gateway(app)
    app.state.gateway = gateway
    # first in the list: every MCP message is a request to this one path. The SDK is imported while the app
    # is built (about 0.5 s of server start): importing it in a worker thread meanwhile raced the main
    # thread's compiling on Python 3.11 ("SystemError: AST constructor recursion depth mismatch")
    app.router.routes.insert(0, Route("/mcp", endpoint=gateway))
    return gateway.run()
