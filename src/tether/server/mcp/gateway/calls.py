"""The gateway's tools/call: the fleet tools, contributed tools (scope-checked, as tasks where asked) and a device's
tool (scope, filter and name checked, a task or an input-required question where the client's era allows)."""


from __future__ import annotations

import logging
from typing import Any

import mcp_types as types
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from starlette.applications import Starlette

from tether.protocol.models import Result
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.fleet.scopes import reaches
from tether.server.aip.hub import DeviceHub
from tether.server.mcp.contributed import GatewayCall, GatewayReply, GatewayTool, contributed
from tether.server.mcp.gateway.questions import GatewayQuestions, _ask_later
from tether.server.mcp.handlers.context import (
    admitted_of,
    caller_of,
    declared_elicitation,
    declared_tasks,
    elicit_of,
    progress_of,
)
from tether.server.mcp.handlers.task_routes import TaskRoutes
from tether.server.mcp.handlers.tasks import CallTasks
from tether.server.mcp.listing import FleetIndex, list_devices
from tether.server.mcp.tools import search
from tether.server.mcp.tools.tool_call import AskLater, Caller, Reply, call_device_tool
from tether.server.mcp.tools.translate import call_result, capped
from tether.server.store import Store
from tether.server.trust.approvals import how_a_person_approves, server_url

logger = logging.getLogger(__package__)

MAX_NAME_ECHO = 120  # how much of an unknown tool name an error repeats


class GatewayCalls(GatewayQuestions):
    """The calling part of `tether.server.mcp.gateway.Gateway`, which sets every attribute below in its
    constructor."""

    app: Starlette
    hub: DeviceHub
    store: Store
    registry: DeviceRegistry
    index: FleetIndex
    task_routes: TaskRoutes
    tasks: CallTasks

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
