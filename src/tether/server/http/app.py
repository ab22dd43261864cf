"""The agent server as one ASGI app: the AIP WebSocket endpoint and the REST API, sharing a hub."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.hub import DeviceHub
from tether.server.aip.questions.asked import Sampler
from tether.server.aip.sockets.socket import aip_route
from tether.server.aip.transfer.service import TransferService
from tether.server.http.front import FastRoutes, ServerApp, error_response
from tether.server.http.json_errors import error_message
from tether.server.http.request_guard import RequestGuard
from tether.server.http.routes import admin, commands, devices
from tether.server.http.routes.batches import batch_router
from tether.server.http.routes.commands import run_commands, run_selected
from tether.server.http.routes.device_changes import device_router
from tether.server.http.routes.fleet import mount_fleet
from tether.server.http.routes.pairing import pairing_router
from tether.server.http.routes.policy import policy_router
from tether.server.http.routes.transfers import transfer_router
from tether.server.http.routes.webhooks import webhook_router
from tether.server.mcp import mount_gateway
from tether.server.notify.notifier import Notifier
from tether.server.ports import RemoteSlot
from tether.server.settings import ServerSettings
from tether.server.store import Store, StoreUnavailable
from tether.server.trust.approvals import server_url
from tether.server.trust.oidc.bearer import Bearers
from tether.server.trust.pairing import PairingBook
from tether.server.web import mount_web
from tether.version import __version__

Extension = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(settings: ServerSettings, store: Store | None = None, extensions: Sequence[Extension] = (), *,
               sampler: Sampler | None = None) -> FastAPI:
    """Build the app; the hub starts and stops with the app's lifespan. `sampler` answers devices' sampling
    requests (their external MCP servers asking for an LLM completion); without one they are refused.

    An extension adds routes to the app when called and is then entered as a context inside the
    lifespan, after the hub starts and before it stops. That is how layers above the server (the
    agent's task API) plug in without the server importing them.
    """
    store = store or Store(settings.db_target)
    registry = DeviceRegistry()  # the hub keeps it current; the routes read it (app.state.registry)
    remote = RemoteSlot()  # the cluster node attaches itself while it runs (server/cluster); empty on one server
    notifier = Notifier(store, settings, server_url(settings))  # webhooks and the inbox's live signal
    hub = DeviceHub(store, settings, registry, remote=remote, sampler=sampler, notifier=notifier)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await hub.start()
        node = None
        stop_screen: Callable[[], None] | None = None
        try:
            await notifier.start()
            if settings.cluster_url:  # one node of several (server/cluster): devices held elsewhere reachable
                from tether.server.cluster.node import ClusterNode

                node = app.state.cluster = ClusterNode(hub, registry, store, settings, remote)
                await node.start()
                stop_screen = app.state.screen_nodes.start()  # live views across nodes (web/screen_nodes.py)
            async with AsyncExitStack() as stack:
                for context in contexts:
                    await stack.enter_async_context(context)
                yield
        finally:
            if stop_screen is not None:
                stop_screen()
            if node is not None:
                await node.aclose()
            await notifier.aclose()
            await hub.aclose()
            store.close()

    app = ServerApp(title="tether agent server", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Devices, their tools, and commands run on them. AIP devices connect "
                              "to the WebSocket endpoint /aip.")
    app.state.hub = hub
    app.state.registry = registry
    app.state.store = store
    app.state.settings = settings
    app.state.bearer = bearer = Bearers(store.tokens, settings.oidc)  # our API tokens, then OIDC (server/trust/oidc)
    app.state.notifier = notifier
    app.state.on_stopping = [notifier.changes.close]  # the inbox's event streams end as the shutdown begins
    app.include_router(devices.router)  # /health and the devices
    app.include_router(commands.router)  # the command routes (answered by front.py), cancelling, questions
    app.include_router(admin.router)  # tokens and the audit log
    app.include_router(policy_router)
    app.include_router(batch_router)  # GET /api/v1/batches/{id}: a batch's record (docs/outcomes.md)
    app.include_router(device_router)  # DELETE /api/v1/devices/{name}: forget a device (docs/fleet.md)
    app.include_router(webhook_router)  # /api/v1/webhooks: notifications (docs/approvals.md)
    mount_fleet(app)  # POST /api/v1/fleet/commands: one batch to every matching device
    app.state.transfers = TransferService(hub, settings)  # files between devices (docs/transfer.md)
    app.include_router(transfer_router)  # POST /api/v1/transfers
    if settings.pairing:
        app.state.pairing = PairingBook(store, on_change=registry.notify)  # the dashboard shows requests live
        app.include_router(pairing_router)
    aip = aip_route(hub)
    app.router.routes.append(aip)
    fast_sockets = {}
    if settings.cluster_url and settings.cluster_link != "off":  # the other nodes' direct links (server/cluster)
        from tether.server.cluster.endpoint import link_route
        from tether.server.cluster.link import LINK_PATH

        link = link_route(app)
        app.router.routes.append(link)
        fast_sockets[LINK_PATH] = link.endpoint
    mount_web(app)  # the dashboard at /, and /docs + /redoc from packaged assets
    gateway = mount_gateway(app)  # the fleet as an MCP server at /mcp (server/mcp)
    contexts = [gateway, *(extension(app) for extension in extensions)]

    api_token_ok = bearer.body_ok

    # Host/Origin checks and body caps for every route, today's and the extensions' (the request_guard package)
    app.add_middleware(RequestGuard, settings=settings, api_token_ok=api_token_ok)
    # ...and the hot routes answered before FastAPI's stack, behind the same guard (front.py)
    app.fast = FastRoutes(lambda route: RequestGuard(route, settings=settings, api_token_ok=api_token_ok),
                          run_commands, run_selected, aip.endpoint, sockets=fast_sockets, mcp=app.state.gateway)

    # Starlette's HTTPException (FastAPI's subclasses it): the router's own 404 and 405 included
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        response = error_response(exc)
        if exc.status_code == 405:  # every method the path answers, not only the first route's
            response.headers["Allow"] = ", ".join(sorted(allowed_methods(request)))
        return response

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        return error_response(exc)  # a full or read-only disk: nothing was done, and saying so beats a bare 500

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)  # the middleware that calls this re-raises, so uvicorn logs the traceback

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {error_message(e)}" for e in exc.errors()[:10])
        return JSONResponse({"error": f"invalid request: {problems}"}, status_code=422)

    return app


def allowed_methods(request: Request) -> set[str]:
    """The methods of every route whose path matches (GET and POST on one path are two routes), the hot
    routes front.py answers included (they answer POST only)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    fast = getattr(request.app, "fast", None)
    if fast is not None and fast.match({**request.scope, "method": "POST"}) is not None:
        methods.add("POST")
    return methods
