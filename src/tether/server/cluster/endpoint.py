"""The WebSocket route other nodes dial for a direct link to this one (link.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from tether.server.cluster.link import LINK_PATH
from tether.server.http.request_guard import deny_websocket


def link_endpoint(app: Any) -> Callable[[WebSocket], Awaitable[None]]:
    """The endpoint of `LINK_PATH`, answered by the running `ClusterNode` of `app` (`app.state.cluster`);
    refused (403) while the node is not running or runs without links. The app serves it ahead of FastAPI's
    middleware stack (front.FastRoutes, behind the same request guard), since each frame a link receives
    resumes the endpoint's task through every frame of the chain around it."""

    async def endpoint(websocket: WebSocket) -> None:
        node = getattr(app.state, "cluster", None)
        links = node.bus.links if node is not None else None
        if links is None:
            await deny_websocket(websocket.scope, websocket.send, 403, "this node takes no cluster links")
            return
        await links.accept(websocket)

    return endpoint


def link_route(app: Any) -> WebSocketRoute:
    """`LINK_PATH` as a route of the app's router too (`link_endpoint`)."""
    return WebSocketRoute(LINK_PATH, link_endpoint(app))
