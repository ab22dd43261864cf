"""`Gateway`: the fleet as an MCP server, streamable HTTP at `/mcp` on the agent server's port.

Built on the official SDK's low-level `Server` (its tool list is computed per request, which the fleet
needs: devices come and go) and `StreamableHTTPSessionManager`. In front of the SDK sits an ASGI check of
the API token (`Authorization: Bearer`; 401 `{"error": …}` with `WWW-Authenticate: Bearer resource_metadata=…`
(RFC 9728, resource_metadata.py) without a valid one, 403 for a device token or a token without `read`),
repeated on every request so a revoked token stops at once; an MCP session stays bound to the token that
opened it. The app's `RequestGuard` (Host/Origin, body caps) runs before all of this, as for every route.

Scopes: `read` lists (every request needs it), `execute` calls device tools, `approve` answers approvals
and questions (a person's token only: an agent's never approves, docs/security/approvals.md); a
contributed tool names its own. A call a token may not make is a tool error saying which
scope is missing, never a silent refusal.

Clients of the handshake era (protocol 2025-xx, what today's desktop and IDE clients speak) are told
`notifications/tools/list_changed` on their session's stream when a device they list registers, leaves or
reports new tools (and resources/prompts `list_changed` when its external MCP servers came or went);
clients of the 2026-07-28 era get the same through `subscriptions/listen` (watch.py, handlers/listen.py),
and may follow their tasks there (`taskIds`). A client of the tasks extension gets device calls that ask or
run long (handlers/tasks.py) and the agent's `run_task` (handlers/tool_tasks.py) as tasks.
Each request is answered with one JSON body unless its call streams something first (transport.py).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp.server import Server
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.caching import CacheHint
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.models import InitializationOptions
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from starlette.applications import Starlette

from tether.protocol.models import Result
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.hub import DeviceHub
from tether.server.approvals import how_a_person_approves, server_url
from tether.server.mcp import search
from tether.server.mcp.admission import Admitted, Refused, admit, deny
from tether.server.mcp.contributed import GatewayCall, GatewayReply, GatewayTool, contributed
from tether.server.mcp.handlers.context import (
    ELICIT_TIMEOUT,
    SCOPE_KEY,
    admitted_of,
    caller_of,
    declared_elicitation,
    declared_tasks,
    elicit_of,
    progress_of,
    task_owner,
    who,
)
from tether.server.mcp.handlers.listen import FleetListen
from tether.server.mcp.handlers.paging import checked_cursor, page
from tether.server.mcp.handlers.resources import FleetResources
from tether.server.mcp.handlers.task_routes import TaskRoutes
from tether.server.mcp.handlers.tasks import EXTENSION
from tether.server.mcp.listing import (
    LIST_DEVICES_INPUT,
    LIST_DEVICES_OUTPUT,
    FleetIndex,
    ScopedFilter,
    list_devices,
)
from tether.server.mcp.tool_call import AskLater, Caller, Reply, call_device_tool
from tether.server.mcp.translate import (
    call_result,
    capped,
    contributed_tool,
    device_tool,
    plain_errors,
)
from tether.server.mcp.transport import ReplyingSessionManager
from tether.server.mcp.watch import ListChangedWatch
from tether.server.scopes import reaches
from tether.server.store import Store
from tether.server.store.tokens import TokenInfo
from tether.version import __version__

logger = logging.getLogger(__name__)

MAX_DEFERRED = 1024  # questions to 2026-07-28 clients awaiting their retry
# sessions one token may hold open at once: the SDK's own cap (10,000) is for the whole server, so without
# this one token (a read-only one too) could open them all and lock every other client out; at the cap, the
# token's least recently used idle session is ended to make room (ReplyingSessionManager.make_room)
MAX_SESSIONS_PER_TOKEN = 64
MAX_NAME_ECHO = 120  # how much of an unknown tool name an error repeats
QUESTION_KEY = "approval"
# cache hints of 2026-07-28 results (ttlMs, cacheScope): every list is the token's own view of the fleet
# (private); a client may reuse a list this long, and hears of a tool-list change sooner through
# subscriptions/listen; a resource is read afresh each time
LIST_TTL_MS = 10_000
CACHE_HINTS = {**{method: CacheHint(ttl_ms=LIST_TTL_MS, scope="private") for method in (
    "tools/list", "resources/list", "resources/templates/list", "prompts/list")},
    "resources/read": CacheHint(ttl_ms=0, scope="private")}
INSTRUCTIONS = ("A tether fleet: `list_devices` shows the machines; each online device's tools are listed as "
                "DEVICE__TOOL (e.g. laptop__shell.run). When the fleet has too many tools to list at once, "
                "tools/list gives only the fleet tools and `find_tools`: search there and call the names it "
                "returns. Calls go through each device's policy and approvals.")


class _FleetServer(Server[Any]):
    """The low-level server, saying in its handshake that its lists change and that tools/call may be a task."""

    def create_initialization_options(self, notification_options: NotificationOptions | None = None,
                                      experimental_capabilities: dict[str, dict[str, Any]] | None = None,
                                      extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        options = super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True, resources_changed=True,
                                                        prompts_changed=True),
            experimental_capabilities, extensions)
        # 2025-11-25's core tasks for tools/call (run_task, handlers/task_routes.py; the SDK drops the
        # capability for 2026-07-28, whose tasks are the extension declared beside it)
        options.capabilities.tasks = types.ServerTasksCapability(
            list=types.TasksListCapability(), cancel=types.TasksCancelCapability(),
            requests=types.ServerTasksRequestsCapability(tools=types.TasksToolsCapability(
                call=types.TasksCallCapability())))
        return options


@dataclass(frozen=True)
class _Deferred:
    """A question put to a 2026-07-28 client, waiting for the retry of the same call by the same token."""

    token_id: str
    tool: str
    arguments: str
    held: Result
    expires: float


class Gateway:
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
        self._progressive_over: int = app.state.settings.mcp_progressive_over  # past it, search (search.py)

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        remove = self.hub.on_fleet_change(self.watch.fleet_changed)
        try:
            async with self.manager.run():
                yield
        finally:
            remove()
            self.watch.close()
            self.listen.close()
            self.task_routes.close()

    # -- HTTP: who may come in ------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
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
        # needs no slot, and an idle session of the token makes room (transport.py)
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

    # -- tool list ------------------------------------------------------------------------------

    async def _list_tools(self, ctx: ServerRequestContext[Any],
                          params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        admitted = admitted_of(ctx)
        tools = [types.Tool(name="list_devices", description="The fleet's devices: status, platform, tags, how "
                            "many tools, sandbox, running and queued work.", input_schema=LIST_DEVICES_INPUT,
                            output_schema=LIST_DEVICES_OUTPUT,
                            annotations=types.ToolAnnotations(read_only_hint=True, destructive_hint=False))]
        tools += [contributed_tool(t) for t in contributed(self.app).values()]
        listed = self.index.listed(admitted.keep)
        big = search.progressive(len(listed), self._progressive_over)  # a big fleet: searched, not listed
        tools += [search.search_tool()] if big else [device_tool(t) for t in listed]
        shown, more = page("tools/list", tools, checked_cursor(params), self._page_size)
        return types.ListToolsResult(tools=shown, next_cursor=more)

    # -- resources and prompts of the devices' external MCP servers (handlers/resources.py) --------------

    async def _list_resources(self, ctx: ServerRequestContext[Any],
                              params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
        admitted = admitted_of(ctx)
        checked_cursor(params, "resources/list")  # an invalid cursor is refused before the devices are asked
        listed = await self.resources.list_resources(admitted.keep, caller_of(ctx, admitted))
        shown, more = page("resources/list", listed.resources, checked_cursor(params), self._page_size)
        return types.ListResourcesResult(resources=shown, next_cursor=more)

    async def _list_templates(self, ctx: ServerRequestContext[Any],
                              params: types.PaginatedRequestParams | None) -> types.ListResourceTemplatesResult:
        admitted = admitted_of(ctx)
        checked_cursor(params, "resources/templates/list")
        listed = await self.resources.list_templates(admitted.keep, caller_of(ctx, admitted))
        shown, more = page("resources/templates/list", listed.resource_templates, checked_cursor(params),
                           self._page_size)
        return types.ListResourceTemplatesResult(resource_templates=shown, next_cursor=more)

    async def _read_resource(self, ctx: ServerRequestContext[Any],
                             params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        admitted = admitted_of(ctx)
        return await self.resources.read(admitted.keep, caller_of(ctx, admitted), str(params.uri))

    async def _list_prompts(self, ctx: ServerRequestContext[Any],
                            params: types.PaginatedRequestParams | None) -> types.ListPromptsResult:
        admitted = admitted_of(ctx)
        checked_cursor(params, "prompts/list")
        listed = await self.resources.list_prompts(admitted.keep, caller_of(ctx, admitted))
        shown, more = page("prompts/list", listed.prompts, checked_cursor(params), self._page_size)
        return types.ListPromptsResult(prompts=shown, next_cursor=more)

    async def _get_prompt(self, ctx: ServerRequestContext[Any],
                          params: types.GetPromptRequestParams) -> types.GetPromptResult:
        admitted = admitted_of(ctx)
        return await self.resources.get_prompt(admitted.keep, caller_of(ctx, admitted), params.name,
                                               params.arguments)

    async def _complete(self, ctx: ServerRequestContext[Any],
                        params: types.CompleteRequestParams) -> types.CompleteResult:
        admitted = admitted_of(ctx)
        return await self.resources.complete(admitted.keep, caller_of(ctx, admitted), params)

    # -- calls ----------------------------------------------------------------------------------

    async def _call_tool(self, ctx: ServerRequestContext[Any],
                         params: types.CallToolRequestParams) -> types.CallToolResult | types.InputRequiredResult:
        admitted = admitted_of(ctx)
        arguments = dict(params.arguments or {})
        caller = caller_of(ctx, admitted)
        name = params.name
        if name == "list_devices":
            try:
                return call_result(Reply("", list_devices(self.registry, arguments, admitted.token)), as_json=True)
            except ValueError as exc:
                return call_result(Reply(f"list_devices: {exc}", is_error=True))
        if name == search.NAME:  # callable whether or not it is listed; sees what tools/list would list
            try:
                found = search.find_tools(self.index, self.registry, admitted.keep, search.Query.parse(arguments))
            except ValueError as exc:
                return call_result(Reply(f"{search.NAME}: {exc}", is_error=True))
            return call_result(Reply("", found), as_json=True)
        extra = contributed(self.app).get(name)
        if extra is not None:
            return await self._call_contributed(ctx, extra, arguments, caller)
        tool = self.index.tools().get(name)
        shown = repr(name[:MAX_NAME_ECHO]) + ("..." if len(name) > MAX_NAME_ECHO else "")
        token = admitted.token
        if token.scoped and (tool is None or not reaches(token, self.registry, tool.device)):
            # outside the scope and never listed are told alike: the answer does not say what exists
            return call_result(Reply(f"no tool named {shown} on the devices in the scope of token '{token.name}' "
                                     f"({token.scope_text()}); list the tools again", is_error=True))
        if tool is None:
            why = (f"{shown} names tools of more than one device (their names escape to the same MCP name), so it "
                   "is listed for none and called on none; call the device through the REST API"
                   if self.index.is_ambiguous(name) else
                   f"no tool named {shown}: the device may have gone offline or dropped the tool; list the tools again")
            return call_result(Reply(why, is_error=True))
        if not admitted.keep.admits(tool.device):  # the filter narrows what this client may call, not only see
            return call_result(Reply(f"{shown} is on device {tool.device}, outside this connection's devices= "
                                     "filter; connect without the filter (or with one naming it) to call it",
                                     is_error=True))
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS and declared_tasks(ctx) \
                and params.request_state is None:  # a long call or one with a question becomes a task
            progress, limit = progress_of(ctx), self.app.state.settings.max_response_bytes

            async def work(asks: Any) -> types.CallToolResult:
                reply = await call_device_tool(self.hub, tool, arguments, caller, progress, asks,
                                               audit=self.store.audit)
                return call_result(capped(reply, limit), device=tool.device)

            return await self.tasks.run(admitted.token.id, work, declared_elicitation(ctx))  # type: ignore[return-value]
        held: Result | None = None
        elicit = elicit_of(ctx)
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:  # questions ride the input-required retry
            elicit = _ask_later if declared_elicitation(ctx) else None
            if params.request_state is not None:
                retry = self._retry(params, admitted.token, name, arguments)
                if isinstance(retry, str):
                    return call_result(Reply(retry, is_error=True))
                held, elicit = retry
        try:
            reply = await call_device_tool(self.hub, tool, arguments, caller, progress_of(ctx), elicit, held=held,
                                           audit=self.store.audit)
        except AskLater as later:
            return self._defer(later, admitted.token, name, arguments)
        return call_result(capped(reply, self.app.state.settings.max_response_bytes), device=tool.device)

    # -- questions of 2026-07-28 clients: an input-required result, answered by retrying the call --------

    def _defer(self, later: AskLater, token: TokenInfo, name: str, arguments: dict[str, Any]
               ) -> types.InputRequiredResult | types.CallToolResult:
        if later.held is None:
            return call_result(Reply(later.message, is_error=True))
        while len(self._deferred) >= MAX_DEFERRED:  # the oldest unanswered questions go first
            del self._deferred[next(iter(self._deferred))]
        state = secrets.token_urlsafe(18)
        self._deferred[state] = _Deferred(token.id, name, _fingerprint(arguments), later.held,
                                          time.monotonic() + ELICIT_TIMEOUT)
        ask = types.ElicitRequest(params=types.ElicitRequestFormParams(message=later.message,
                                                                       requested_schema=later.schema))
        return types.InputRequiredResult(input_requests={QUESTION_KEY: ask}, request_state=state)

    def _retry(self, params: types.CallToolRequestParams, token: TokenInfo, name: str,
               arguments: dict[str, Any]) -> tuple[Result, Any] | str:
        """The held result and the client's answer of a retried call, or why the retry cannot be used."""
        deferred = self._deferred.pop(params.request_state or "", None)
        answer = (params.input_responses or {}).get(QUESTION_KEY)
        if deferred is None or deferred.expires < time.monotonic() or deferred.token_id != token.id \
                or deferred.tool != name or deferred.arguments != _fingerprint(arguments):
            return "this answer belongs to no question waiting here (expired, answered, or another call's); call again"
        if answer is None or not hasattr(answer, "action"):
            return "the retried call carries no answer to the question it was asked; call again"
        reply = {"action": answer.action, "content": getattr(answer, "content", None)}

        async def answered(message: str, schema: dict[str, Any]) -> dict[str, Any]:
            return reply

        return deferred.held, answered

    async def _task_call_2025(self, ctx: ServerRequestContext[Any], call_next: CallNext) -> HandlerResult:
        """A 2025-11-25 `tools/call` asking for a task (`params.task`) of a contributed tool that has tasks:
        answered here with its `CreateTaskResult`, which the SDK's result check of tools/call would refuse."""
        params = ctx.params if isinstance(ctx.params, dict) else None
        if ctx.method != "tools/call" or ctx.protocol_version in MODERN_PROTOCOL_VERSIONS or params is None \
                or not isinstance(params.get("task"), dict):
            return await call_next(ctx)
        tool = contributed(self.app).get(str(params.get("name")))
        arguments = params.get("arguments") or {}
        if tool is None or tool.tasks is None or not isinstance(arguments, dict):
            return await call_next(ctx)
        admitted = admitted_of(ctx)
        return await self._call_contributed(ctx, tool, dict(arguments), caller_of(ctx, admitted), as_task=True)

    async def _call_contributed(self, ctx: ServerRequestContext[Any], tool: GatewayTool, arguments: dict[str, Any],
                                caller: Caller, as_task: bool = False) -> types.CallToolResult:
        if caller.token.agent and tool.scope == "approve":  # approving is a person's, whatever the scopes
            return call_result(Reply(f"token '{caller.token.name}' is an agent's token, and an agent never approves: "
                                     f"{tool.name} needs a person's token ("
                                     f"{how_a_person_approves(server_url(self.app.state.settings))})", is_error=True))
        if not caller.token.allows(tool.scope):
            return call_result(Reply(f"token '{caller.token.name}' lacks the '{tool.scope}' scope needed for "
                                     f"{tool.name}; create one with 'tether token create --api NAME --scope "
                                     f"{tool.scope}'", is_error=True))
        if tool.tasks is not None and (as_task or (ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
                                                   and declared_tasks(ctx))):
            # a client of the tasks extension (or a 2025-11-25 client asking) gets the task at once
            started = await self.task_routes.start(ctx, tool, arguments)
            if isinstance(started, GatewayReply):
                return _tool_result(started)
            return started  # (a CreateTaskResult: the SDK passes a dict on)
        call = GatewayCall(token=caller.token, client=caller.client.split(" ", 1)[0], progress=progress_of(ctx),
                           elicit=elicit_of(ctx))
        try:
            reply = await tool.handler(arguments, call)
        except Exception:
            logger.exception("MCP gateway: tool %s failed", tool.name)
            return call_result(Reply(f"{tool.name} failed inside the server; the server log has the details",
                                     is_error=True))
        return _tool_result(reply)


def _tool_result(reply: GatewayReply) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=reply.text)],
                                structured_content=reply.structured, is_error=reply.is_error)


async def _ask_later(message: str, schema: dict[str, Any]) -> dict[str, Any]:
    raise AskLater(message, schema)


def _fingerprint(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, default=str)
