"""`Gateway`, made of its parts in this package (`calls`, `lists`, `questions`) with its own construction, its
run (the fleet watch, the session manager) and the ASGI entry that admits a request."""


from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.applications import Starlette

from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.hub import DeviceHub
from tether.server.mcp.front.admission import Admitted, Refused, admit, deny
from tether.server.mcp.front.transport import ReplyingSessionManager
from tether.server.mcp.gateway.calls import GatewayCalls
from tether.server.mcp.gateway.fleet_server import CACHE_HINTS, INSTRUCTIONS, _FleetServer
from tether.server.mcp.gateway.lists import GatewayLists
from tether.server.mcp.gateway.questions import _ask_later, _Deferred
from tether.server.mcp.handlers.context import SCOPE_KEY, task_owner, who
from tether.server.mcp.handlers.listen import FleetListen
from tether.server.mcp.handlers.resources import FleetResources
from tether.server.mcp.handlers.task_routes import TaskRoutes
from tether.server.mcp.handlers.tasks import EXTENSION
from tether.server.mcp.handlers.watch import ListChangedWatch
from tether.server.mcp.listing import FleetIndex, ScopedFilter
from tether.server.mcp.tools.translate import plain_errors
from tether.server.store import Store
from tether.version import __version__

# sessions one token may hold open at once: the SDK's own cap (10,000) is for the whole server, so without
# this one token (a read-only one too) could open them all and lock every other client out; at the cap, the
# token's least recently used idle session is ended to make room (ReplyingSessionManager.make_room)
MAX_SESSIONS_PER_TOKEN = 64


class Gateway(GatewayCalls, GatewayLists):
    """The ASGI app behind `/mcp`, built on the first request (`LazyGateway`), which then enters `run()`."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.hub: DeviceHub = app.state.hub
        self.store: Store = app.state.store
        self.registry: DeviceRegistry = app.state.registry  # the devices it lists
        self.index = FleetIndex(self.registry)
        # device calls and run_task as tasks, tasks/* of both eras (handlers/task_routes.py)
        self.task_routes = TaskRoutes(lambda event: self.listen.publish(event), _ask_later)
        self.tasks = self.task_routes.calls
        self.listen = FleetListen(who, self.task_routes.owns, self.task_routes.current, task_owner)
        self.resources = FleetResources(self.hub, self.registry, self.store.audit)
        self.server = _FleetServer("tether", version=__version__, instructions=INSTRUCTIONS,
                                   cache_hints=CACHE_HINTS,  # type: ignore[arg-type]  # (its keys are methods)
                                   on_list_tools=self._list_tools, on_call_tool=self._call_tool,
                                   on_list_resources=self._list_resources,
                                   on_list_resource_templates=self._list_templates,
                                   on_read_resource=self._read_resource, on_list_prompts=self._list_prompts,
                                   on_get_prompt=self._get_prompt, on_completion=self._complete,
                                   on_subscriptions_listen=self.listen)
        self.server.extensions[EXTENSION] = {}
        self.task_routes.register(self.server)
        self.manager = ReplyingSessionManager(  # answers in JSON unless a call has something to stream
            app=self.server, security_settings=None,  # RequestGuard already checked Host and Origin
            max_request_body_size=app.state.settings.max_body_bytes)
        self.manager.per_owner = MAX_SESSIONS_PER_TOKEN  # idle ones make room before a token is refused
        self.watch = ListChangedWatch(self.manager, self.store, self.index, self.listen, who,
                                      self.resources.servers_of, lambda: [r.name for r in self.registry.list()])
        # (no OpenTelemetry span per message: nothing exports them)
        self.server.middleware = [self._task_call_2025, self.watch.middleware]
        self._deferred: dict[str, _Deferred] = {}  # by request_state
        self._page_size: int = app.state.settings.mcp_page_size  # items per page of every list (paging.py)
        self._progressive_over: int = app.state.settings.mcp_progressive_over  # past it, search (tools/search.py)

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """While entered, the SDK's session manager runs and fleet changes reach the list-changed watch; on
        exit the watch, the listen streams and the task routes are closed."""
        remove = self.hub.on_fleet_change(self.watch.fleet_changed)
        try:
            async with self.manager.run():
                yield
        finally:
            remove()
            self.watch.close()
            self.listen.close()
            self.task_routes.close()
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI entry: a WebSocket is closed (1008); a request without a token admitted here is refused
        (`admit`: 401 or 403, `{"error": ...}`), and one that would open a session past the token's
        `MAX_SESSIONS_PER_TOKEN` with none idle gets 429; the rest go to the SDK bound to their token and scope."""
        if scope["type"] != "http":  # a WebSocket to /mcp: MCP has none
            await send({"type": "websocket.close", "code": 1008, "reason": "MCP is served over HTTP POST/GET"})
            return
        admitted = await admit(self.app.state.bearer, scope)
        if isinstance(admitted, Refused):
            await deny(scope, receive, send, admitted.status, admitted.error, admitted)
            return
        token = admitted.token
        headers = dict(scope.get("headers") or ())
        version = headers.get(b"mcp-protocol-version")
        modern = version is not None and version.decode("latin-1") not in HANDSHAKE_PROTOCOL_VERSIONS
        # only a handshake-era POST without a session id opens a session; a stateless (2026-07-28) request
        # needs no slot, and an idle session of the token makes room (front/transport.py)
        if b"mcp-session-id" not in headers and scope.get("method") == "POST" and not modern \
                and not self.manager.make_room(token.id):
            await deny(scope, receive, send, 429,
                       f"all {MAX_SESSIONS_PER_TOKEN} MCP sessions of token '{token.name}' (the most one token may "
                       "hold) are serving a request right now; retry when one of them has answered")
            return
        # a scoped token's client lists, calls and hears of only the devices in its scope (docs/security/scopes.md)
        admitted = Admitted(token, ScopedFilter.of(admitted.keep, token, self.registry))
        scope[SCOPE_KEY] = admitted
        # binds each MCP session to the token that opened it (the SDK answers 404 to any other)
        scope["user"] = AuthenticatedUser(AccessToken(token=token.id, client_id=token.id, scopes=token.scopes))
        if modern:
            # the 2026-07-28 era and unknown versions: the SDK's structured rejections (supported versions in
            # the error's data) are what such a client negotiates with, so its errors stay JSON-RPC
            await self.manager.handle_request(scope, receive, send)
            return
        await self.manager.handle_request(scope, receive, plain_errors(send))
