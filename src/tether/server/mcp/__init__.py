"""The fleet as an MCP server: the gateway mounted at `/mcp` on the agent server.

The app factory mounts it; it imports nothing from `server/web`, `server/cluster` or `tether.agent`.
Layers above the server (the agent's task tools) add their tools through `contributed.py`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from starlette.applications import Starlette

if TYPE_CHECKING:
    from tether.server.mcp.gateway import Gateway


def mount_gateway(app: Starlette) -> AbstractAsyncContextManager[None]:
    """Add `/mcp` to `app` (which has `state.hub`, `state.store`, `state.settings`) and return the context
    the app's lifespan enters. The `mcp` SDK is imported, and the gateway built, on the first request to
    `/mcp` that carries a valid token (lazy_gateway.py), not when the app is: `app.state.gateway` is that
    `LazyGateway`, whose `ready()` gives the running `Gateway`. Also adds `/mcp`'s Protected Resource Metadata
(RFC 9728) at `/.well-known/oauth-protected-resource[/mcp]` (front/resource_metadata.py)."""
    from starlette.routing import Route

    from tether.server.mcp.contributed import contribute
    from tether.server.mcp.front.resource_metadata import WELL_KNOWN, metadata_endpoint
    from tether.server.mcp.lazy_gateway import LazyGateway
    from tether.server.mcp.tools.fanout_tool import fan_out_tool

    # the fleet's own fan-out, beside the agent's task tools
    contribute(app, [fan_out_tool(app.state.hub, app.state.registry)])
    lazy = LazyGateway(app, _build)
    app.state.gateway = lazy
    app.router.routes.insert(0, Route("/mcp", endpoint=lazy))  # first: every MCP message is a request to it
    for path in (WELL_KNOWN + "/mcp", WELL_KNOWN):  # RFC 9728: where a client finds how to authorize
        app.router.routes.insert(1, Route(path, endpoint=metadata_endpoint, methods=["GET"]))
    return lazy.run()


def _build(app: Starlette) -> Gateway:
    from tether.server.mcp.gateway import Gateway  # imports the SDK

    return Gateway(app)
