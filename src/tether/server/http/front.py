"""`ServerApp`: the agent server's ASGI app, with its hot routes served ahead of FastAPI's middleware stack.

Two routes carry nearly all of a fleet's traffic: the AIP WebSocket (one long-lived socket per device)
and the command POSTs (one request per batch); MCP clients send every message to `/mcp`. Through FastAPI
each passed about ten ASGI layers — Starlette's error and exception middlewares, FastAPI's telemetry,
body-limit and exit-stack middlewares, two routers, the endpoint wrappers — and each wraps `send` in a
closure of its own. Measured with
`bench/fleet_hotpath.py` and py-spy, those layers were ~20% of the server's CPU per command, and for
a device socket their frames and closures live as long as the socket (`bench/fleet_devices.py`'s
memory per idle device).

So `ServerApp.__call__` looks at the scope first: `POST /api/v1/devices/{name}/commands`,
`POST /api/v1/commands`, the `/aip` WebSocket and HTTP requests to `/mcp` (the MCP gateway, which does its own
token checks) go to their endpoints through `RequestGuard` alone —
the same Host/Origin rules and body caps as every other route (the request_guard package) — and everything else,
lifespan included, to FastAPI. The command endpoints are also FastAPI's routes for the same paths
(`FastRoute`: the same function, documented in the OpenAPI document); errors are the same `{"error": …}`
bodies (`error_response`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket

from tether.server.http import internals
from tether.server.http.ratelimit import Throttles
from tether.server.http.request_guard import (
    ASGIApp,
    BodyTooLarge,
    Message,
    RequestGuard,
    Scope,
    throttled_handshake,
)
from tether.server.store import StoreUnavailable

logger = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
# refusals made on purpose, never logged as failures: a route's own answer, a state that cannot be written, a body
# past its cap (the guard answers 413 itself)
EXPECTED = (HTTPException, StoreUnavailable, BodyTooLarge)
SocketEndpoint = Callable[[WebSocket], Awaitable[None]]

DEVICES_PREFIX = "/api/v1/devices/"
COMMANDS_SUFFIX = "/commands"
SELECTED_PATH = "/api/v1/commands"
MCP_PATH = "/mcp"


def error_response(exc: Exception) -> JSONResponse:
    """The `{"error": …}` answer for an exception a route raised: an `HTTPException` as itself, a store
    that cannot write as 503 (nothing was done), anything else as a 500 whose details stay in the log."""
    if isinstance(exc, HTTPException):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=dict(exc.headers or {}))
    if isinstance(exc, StoreUnavailable):  # a full or read-only disk
        return JSONResponse({"error": f"the server cannot write its state: {exc}"}, status_code=503,
                            headers={"Retry-After": "5"})
    return JSONResponse({"error": "internal server error; the server log has the details"}, status_code=500)


def http_endpoint(handler: Handler) -> ASGIApp:
    """`handler` as an ASGI app: a Starlette `Request` in, its `Response` sent; what it raises answered
    by `error_response` (and logged when unexpected)."""

    async def app(scope: Scope, receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        try:
            response = await handler(Request(scope, receive, send))
        except Exception as exc:  # every error is an answer; the unexpected ones are logged
            if not isinstance(exc, EXPECTED):
                logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            response = error_response(exc)
        await response(scope, receive, send)

    return app


def asgi_endpoint(app: ASGIApp) -> ASGIApp:
    """`app` (an ASGI app served as a hot route) answering what it raises as the app's routes do: with
    `error_response` when it has not begun its answer (logged when unexpected); an error after that is raised
    on, and the server ends the response as it would for any route."""

    async def endpoint(scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await app(scope, receive, sending)
        except Exception as exc:
            if started:
                raise
            if not isinstance(exc, EXPECTED):
                logger.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await error_response(exc)(scope, receive, send)

    return endpoint


def socket_endpoint(endpoint: SocketEndpoint) -> ASGIApp:
    """`endpoint` as an ASGI app: called with a Starlette `WebSocket` of the scope."""

    async def app(scope: Scope, receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        await endpoint(WebSocket(scope, receive, send))

    return app


def route_path(scope: Scope) -> str:
    """The path the app's routes are matched on: behind a proxy's path prefix (uvicorn's `root_path`, which
    it puts in front of `path` as the ASGI spec says) the part after the prefix, as Starlette's routing does."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] == "/":
        return path[len(root):]
    return path


class FastRoutes:
    """The hot routes, each behind its own `RequestGuard`; `match(scope)` picks one or None."""

    def __init__(self, guard: Callable[[ASGIApp], RequestGuard], run_commands: Handler, run_selected: Handler,
                 aip: SocketEndpoint, aip_path: str = "/aip", sockets: Mapping[str, SocketEndpoint] | None = None,
                 mcp: ASGIApp | None = None) -> None:
        self.run_commands = guard(http_endpoint(run_commands))
        self.run_selected = guard(http_endpoint(run_selected))
        # the MCP gateway (every MCP message is an HTTP request to it, whatever its method); also mounted in FastAPI
        self.mcp = guard(asgi_endpoint(mcp)) if mcp is not None else None
        self.aip_rules = self.run_commands.rules  # a handshake has no body: the Host/Origin rules are its guard
        self.aip_endpoint = aip
        self.aip_path = aip_path
        # more WebSocket routes (path -> endpoint; a cluster's node links), each behind the whole guard: no
        # middleware frame stays in the chain every received message resumes through
        self.sockets = {path: guard(socket_endpoint(endpoint)) for path, endpoint in (sockets or {}).items()}

    async def aip(self, scope: Scope, receive: Any, send: Any) -> None:
        """The AIP socket: the guard's Host/Origin rules on the handshake, then the endpoint — called from
        here, so that no guard or wrapper frame stays on the stack for the socket's life (each is a few
        hundred bytes per idle device)."""
        headers = dict(scope.get("headers") or ())
        if await self.aip_rules.refused(scope, send, headers) or await throttled_handshake(scope, send, headers):
            return
        await self.aip_endpoint(WebSocket(scope, receive, send))

    def match(self, scope: Scope) -> ASGIApp | None:
        path = route_path(scope)
        if scope["type"] == "websocket":
            return self.aip if path == self.aip_path else self.sockets.get(path)
        if scope["type"] != "http":
            return None
        if path == MCP_PATH:
            return self.mcp
        if scope["method"] != "POST":
            return None
        if path == SELECTED_PATH:
            return self.run_selected
        if path.startswith(DEVICES_PREFIX) and path.endswith(COMMANDS_SUFFIX):
            name = path[len(DEVICES_PREFIX):-len(COMMANDS_SUFFIX)]
            if name and "/" not in name:  # Starlette's `{name}`: one non-empty segment
                internals.set_path_params(scope, {"name": name})
                return self.run_commands
        return None


class FastRoute(APIRoute):
    """A FastAPI route documented from its endpoint's signature (FastAPI reads `__signature__` for the path,
    body and dependency parameters of the OpenAPI document) and answered by the endpoint itself, called with
    the `Request` alone: no dependency solving, body parsing or response serialization (FastAPI's
    `get_route_handler` hook). What the endpoint raises is answered by the app's exception handlers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.endpoint


class ServerApp(FastAPI):
    """FastAPI, with `fast` routes (when set) answered before its middleware stack is entered."""

    fast: FastRoutes | None = None
    _throttles: Throttles | None = None

    @property
    def throttles(self) -> Throttles | None:
        """The app's rate limits (ratelimit.py), made from `state.settings` on first use; None before the
        app has settings. The request guard reads them off `scope["app"]`."""
        if self._throttles is None:
            settings = getattr(self.state, "settings", None)
            if settings is None:
                return None
            self._throttles = Throttles(settings)
        return self._throttles

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        route = self.fast.match(scope) if self.fast is not None and scope["type"] != "lifespan" else None
        if route is None:
            await super().__call__(scope, receive, send)
            return
        internals.enter_app(scope, self)  # what `request.app` reads
        await route(scope, receive, send)
