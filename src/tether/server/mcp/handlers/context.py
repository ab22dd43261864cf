"""The context of one MCP request at `/mcp`: the token and device filter it was admitted with, the caller
as the audit names it, the client's declared capabilities, and how to send it progress or ask it."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError

from tether.server.mcp.front.admission import Admitted
from tether.server.mcp.handlers.tasks import EXTENSION
from tether.server.mcp.listing import DeviceFilter
from tether.server.mcp.tools.tool_call import Caller

SCOPE_KEY = "tether.mcp.caller"  # the ASGI scope entry where the checked token and filter ride to handlers
ELICIT_TIMEOUT = 600.0  # a person answering a question through the client
MISSING_CAPABILITY = -32021  # MCP 2026-07-28's MissingRequiredClientCapability
_CLIENT_PART = re.compile(r"[^A-Za-z0-9._+-]")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def who(ctx: ServerRequestContext[Any]) -> tuple[DeviceFilter, str] | None:
    """The device filter and token id a request was admitted with (see `Gateway.__call__`)."""
    request = ctx.request
    admitted = request.scope.get(SCOPE_KEY) if request is not None else None
    return (admitted.keep, admitted.token.id) if isinstance(admitted, Admitted) else None


def admitted_of(ctx: ServerRequestContext[Any]) -> Admitted:
    """The checked token and device filter of the request (RuntimeError if the SDK did not pass them)."""
    request = ctx.request
    admitted = request.scope.get(SCOPE_KEY) if request is not None else None
    if not isinstance(admitted, Admitted):  # only reachable if the SDK stopped passing the HTTP request
        raise RuntimeError("MCP gateway: request without its checked token")
    return admitted


def caller_of(ctx: ServerRequestContext[Any], admitted: Admitted) -> Caller:
    """Who calls: the token, and the client's `name/version` followed by the W3C trace context the request
    carried in `_meta` (`traceparent`, the OpenTelemetry convention of MCP 2026-07-28) when it is a valid
    one, so the audit row (`requested_by`) ties the device's work to the client's trace."""
    client = client_name(ctx)
    trace = ctx.meta.get("traceparent") if isinstance(ctx.meta, dict) else None
    if isinstance(trace, str) and _TRACEPARENT.match(trace) and trace[:2] != "ff":
        client = f"{client} traceparent={trace}"
    return Caller(admitted.token, client)


def client_name(ctx: ServerRequestContext[Any]) -> str:
    """The client's `name/version` from its initialize, cut to characters safe in the audit."""
    params = ctx.session.client_params
    if params is None:
        return "unknown"
    info = params.client_info
    return f"{_CLIENT_PART.sub('_', info.name)[:64] or 'unknown'}/{_CLIENT_PART.sub('_', info.version)[:32]}"


def progress_of(ctx: ServerRequestContext[Any]) -> Any:
    """`progress(done, total, message)` sending the request's progress notifications (nothing without the
    client's progressToken)."""
    async def progress(done: float, total: float | None, message: str | None) -> None:
        await ctx.session.report_progress(done, total, message)  # a no-op without the client's progressToken

    return progress


def declared_tasks(ctx: ServerRequestContext[Any]) -> bool:
    """Whether the request's client capabilities declare the tasks extension."""
    capabilities = ctx.session.client_capabilities
    return capabilities is not None and EXTENSION in (capabilities.extensions or {})


def task_owner(ctx: ServerRequestContext[Any]) -> str:
    """The token id whose tasks a tasks/* request reaches; MISSING_REQUIRED_CLIENT_CAPABILITY (-32021) for a
    client that did not declare the extension on it, as the extension requires."""
    if not declared_tasks(ctx):
        raise MCPError(MISSING_CAPABILITY, "missing required client capability", {
            "requiredCapabilities": {"extensions": {EXTENSION: {}}}})
    return admitted_of(ctx).token.id


def declared_elicitation(ctx: ServerRequestContext[Any]) -> bool:
    """Whether the client declared the elicitation capability."""
    capabilities = ctx.session.client_capabilities
    return capabilities is not None and capabilities.elicitation is not None


def elicit_of(ctx: ServerRequestContext[Any]) -> Any:
    """`elicit(message, schema)` asking the client by an elicitation request on this request's stream (the
    handshake era), or None when the client cannot be asked that way."""
    if not declared_elicitation(ctx) or not ctx.session.can_send_request:
        return None

    async def elicit(message: str, schema: dict[str, Any]) -> dict[str, Any]:
        async with asyncio.timeout(ELICIT_TIMEOUT):
            answer = await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)
        return {"action": answer.action, "content": answer.content}

    return elicit
