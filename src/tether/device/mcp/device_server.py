"""This machine's whole device — the built-in tool sets and the config's external MCP servers — as one MCP
server for one client (`tether mcp serve --stdio`), with no agent server in between.

Every call goes through the device's own dispatcher, exactly as `tether exec` runs it locally: the same
policy, OS sandbox, undo journal and approval rules. A call the policy reserves for a person is not run;
it comes back as a tool error that says so and how a person can run it (`tether exec … --approve` in a
terminal, or a policy that allows it), so an MCP client never waits on a question nobody sees. Streamed
output and external servers' progress reach the client as progress notifications when it sent a
progress token; the client's `notifications/cancelled` cancels the command (its processes killed).

Tool names: a tool's plain name when no other tool of the device has it, else `namespace/name` (the name
the device itself resolves a shadowed tool by), so every listed tool is callable by what was listed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shlex
import time
from typing import TYPE_CHECKING, Any

import mcp_types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from tether.protocol.models import Command, Result, ToolInfo
from tether.tools.toolsets.mcp_export import result_to_call_result
from tether.version import __version__

if TYPE_CHECKING:
    from tether.device.local import LocalDevice

logger = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 10_000  # progress waiting for a slow client; past it events are dropped (the result is not)
MAX_PROGRESS_TEXT = 4000
DEFAULT_CALL_TIMEOUT = 3600.0  # a call the client gave no deadline (MCP has none): the device's own cap
ELICIT_TIMEOUT = 300.0  # how long an approval question waits for the client's answer
MAX_DEFERRED = 100  # approval questions waiting for a retry; the oldest go first
QUESTION_KEY = "approval"
APPROVE, DENY = "approve once", "deny"
_DECISION: dict[str, Any] = {"type": "object", "required": ["decision"], "properties": {"decision": {
    "type": "string", "title": "Decision", "enum": [APPROVE, DENY]}}}


def mcp_names(infos: list[ToolInfo]) -> dict[str, ToolInfo]:
    """Each tool under one MCP name: its own when unique, else `namespace/name`; a tool that would still
    clash (one server listed under both tool types) keeps the first listed and the rest are logged."""
    counts: dict[str, int] = {}
    for info in infos:
        counts[info.name] = counts.get(info.name, 0) + 1
    named: dict[str, ToolInfo] = {}
    for info in infos:
        name = info.name if counts[info.name] == 1 else f"{info.namespace}/{info.name}"
        if name in named:
            logger.info("mcp serve: %s (%s) is not listed: %s already names a %s tool", name, info.tool_type,
                        name, named[name].tool_type)
            continue
        named[name] = info
    return named


def mcp_tool(name: str, info: ToolInfo) -> mcp_types.Tool:
    """A data_collection tool only reads; an action may change things (the policy, approvals and the undo
    journal are what bound it), as the gateway tells its clients."""
    read_only = info.tool_type == "data_collection"
    hints = mcp_types.ToolAnnotations(read_only_hint=read_only, destructive_hint=not read_only,
                                      open_world_hint=not read_only)
    return mcp_types.Tool(name=name, description=info.description or None, input_schema=info.input_schema,
                          output_schema=info.output_schema, annotations=hints)


class DeviceMCPServer:
    """The device's tools behind a low-level `mcp.server.Server`; `session_id` names the calls' session in
    the undo journal (`tether undo SESSION`)."""

    def __init__(self, device: LocalDevice, session_id: str) -> None:
        self.device = device
        self.session_id = session_id
        self._names: dict[str, ToolInfo] = {}
        # approvals asked of 2026-07-28 clients, by request_state: (tool, arguments, expiry, digest asked about)
        self._deferred: dict[str, tuple[str, str, float, str | None]] = {}

    async def tools(self) -> dict[str, ToolInfo]:
        computer = await self.device.computer_manager.get_or_create(None)
        self._names = mcp_names(computer.tool_infos())
        return self._names

    def server(self) -> Server[Any]:
        return Server("tether-device", version=__version__,
                      instructions="This machine's tools under tether's policy: a refused or held call is a tool "
                                   "error that says why and what a person can do.",
                      on_list_tools=self._list_tools, on_call_tool=self._call_tool)

    async def _list_tools(self, ctx: ServerRequestContext[Any],
                          params: mcp_types.PaginatedRequestParams | None) -> mcp_types.ListToolsResult:
        return mcp_types.ListToolsResult(tools=[mcp_tool(name, info) for name, info in (await self.tools()).items()])

    async def _call_tool(self, ctx: ServerRequestContext[Any], params: mcp_types.CallToolRequestParams
                         ) -> mcp_types.CallToolResult | mcp_types.InputRequiredResult:
        info = self._names.get(params.name) or (await self.tools()).get(params.name)
        if info is None:
            return _error(f"no tool named {params.name!r} on this device; list the tools again")
        arguments = dict(params.arguments or {})
        approved_by: str | None = None
        digest: str | None = None
        if params.request_state is not None:  # a 2026-07-28 client retrying with the approval's answer
            answer = self._answer(ctx, params, arguments)
            if isinstance(answer, mcp_types.CallToolResult):
                return answer
            approved_by, digest = answer
        # the MCP name is what the device resolves: the plain name, or namespace/name for a shadowed one
        command = Command(tool_name=params.name, parameters=arguments, tool_type=info.tool_type,
                          approved_by=approved_by, approval_digest=digest)
        result = await self._run(ctx, command)
        if not _needs_approval(result) or approved_by is not None:
            return result_to_call_result(result)
        if not _declared_elicitation(ctx):
            return _held(params.name, arguments, result)
        question = f"{result.error or 'this call needs approval'}\nRun {params.name} on this machine?"
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:  # questions ride the input-required retry
            return self._ask_later(params.name, arguments, question, _digest(result))
        try:
            async with asyncio.timeout(ELICIT_TIMEOUT):
                reply = await ctx.session.elicit_form(question, _DECISION, related_request_id=ctx.request_id)
        except Exception as exc:  # the client could not answer: nothing runs
            logger.info("mcp serve: approval of %s not asked: %s", params.name, exc)
            return _held(params.name, arguments, result)
        if reply.action != "accept" or (reply.content or {}).get("decision") != APPROVE:
            return _error(f"not run: the approval was {'denied' if reply.action == 'accept' else reply.action + 'd'}"
                          f" ({result.error})")
        # approved for what was asked about: the device recomputes the digest and asks again if anything differs
        command = Command(tool_name=params.name, parameters=arguments, tool_type=info.tool_type,
                          approved_by=_client(ctx), approval_digest=_digest(result))
        return result_to_call_result(await self._run(ctx, command))

    def _ask_later(self, name: str, arguments: dict[str, Any], question: str,
                   digest: str | None) -> mcp_types.InputRequiredResult:
        while len(self._deferred) >= MAX_DEFERRED:  # the oldest unanswered questions go first
            del self._deferred[next(iter(self._deferred))]
        state = secrets.token_urlsafe(18)
        self._deferred[state] = (name, _fingerprint(arguments), time.monotonic() + ELICIT_TIMEOUT, digest)
        ask = mcp_types.ElicitRequest(params=mcp_types.ElicitRequestFormParams(message=question,
                                                                               requested_schema=_DECISION))
        return mcp_types.InputRequiredResult(input_requests={QUESTION_KEY: ask}, request_state=state)

    def _answer(self, ctx: ServerRequestContext[Any], params: mcp_types.CallToolRequestParams,
                arguments: dict[str, Any]) -> tuple[str, str | None] | mcp_types.CallToolResult:
        """(who approved, for the audit; the digest of what was asked about, which the device checks again), or
        the tool error that ends the call: the retry must carry the answer to a question this server asked about
        this very call, in time."""
        deferred = self._deferred.pop(params.request_state or "", None)
        answer = (params.input_responses or {}).get(QUESTION_KEY)
        if deferred is None or deferred[2] < time.monotonic() or deferred[:2] != (params.name,
                                                                                  _fingerprint(arguments)):
            return _error("this answer belongs to no question waiting here (expired, answered, or another "
                          "call's); call again")
        action = getattr(answer, "action", None)
        decision = (getattr(answer, "content", None) or {}).get("decision")
        if action != "accept" or decision != APPROVE:
            return _error(f"not run: the approval was {'denied' if action == 'accept' else f'{action}d'}")
        return _client(ctx), deferred[3]

    async def _run(self, ctx: ServerRequestContext[Any], command: Command) -> Result:
        dispatcher = self.device.dispatcher(session_id=self.session_id)
        events: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue(MAX_QUEUED_EVENTS)

        def emit(kind: str, data: dict[str, Any]) -> None:
            with contextlib.suppress(asyncio.QueueFull):
                events.put_nowait((kind, data))

        dispatcher.emit = emit
        sender = asyncio.create_task(_send_progress(ctx, events))
        try:
            [result] = await dispatcher.execute_commands([command], timeout=DEFAULT_CALL_TIMEOUT + 5)
        finally:
            with contextlib.suppress(asyncio.QueueFull):
                events.put_nowait(None)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await asyncio.shield(sender)
            sender.cancel()
        return result


async def serve_device_stdio(device: LocalDevice, session_id: str) -> None:
    """Serve on stdin/stdout until the client closes stdin."""
    from tether.tools.toolsets.mcp_export import serve_stdio

    await serve_stdio(DeviceMCPServer(device, session_id).server())


async def _send_progress(ctx: ServerRequestContext[Any], events: asyncio.Queue[tuple[str, dict[str, Any]] | None]
                         ) -> None:
    """Each event of a running call as a progress notification (a no-op without the client's token), in order."""
    count = 0
    while (item := await events.get()) is not None:
        kind, data = item
        text = _event_text(kind, data)
        if text is None:
            continue
        count += 1
        progress, wanted = data.get("progress"), data.get("total")
        done = progress if kind == "progress" and isinstance(progress, int | float) else count
        total = wanted if kind == "progress" and isinstance(wanted, int | float) else None
        try:
            async with asyncio.timeout(10):
                await ctx.session.report_progress(float(done), total, text[:MAX_PROGRESS_TEXT])
        except Exception as exc:  # the client went away or is stuck: the call goes on, its result still counts
            logger.info("mcp serve: progress not sent: %s", exc)
            return


def _event_text(kind: str, data: dict[str, Any]) -> str | None:
    if kind == "output":
        return str(data.get("data", ""))
    if kind == "progress":
        where = f"{data.get('server', '')}.{data.get('tool', '')}".strip(".")
        return f"{where}: {data.get('message') or ''}".rstrip(": ")
    if kind in ("queued", "starting"):
        return f"waiting: {kind}"
    return None


def _declared_elicitation(ctx: ServerRequestContext[Any]) -> bool:
    capabilities = ctx.session.client_capabilities
    return capabilities is not None and capabilities.elicitation is not None


def _client(ctx: ServerRequestContext[Any]) -> str:
    """Who approved, for the audit and the journal: the MCP client's name from its handshake."""
    params = ctx.session.client_params
    name = params.client_info.name if params is not None else "unknown"
    return f"mcp:{''.join(c if c.isalnum() or c in '-_.' else '_' for c in name)[:64]}"


def _fingerprint(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, sort_keys=True, default=str)


def _digest(result: Result) -> str | None:
    """The `approval_digest` of a needs-approval result: what the person is asked about (tools/policy/approval)."""
    digest = result.result.get("approval_digest") if isinstance(result.result, dict) else None
    return digest if isinstance(digest, str) else None


def _needs_approval(result: Result) -> bool:
    return not result.ok and isinstance(result.result, dict) and result.result.get("needs_approval") is True


def _held(name: str, arguments: dict[str, Any], result: Result) -> mcp_types.CallToolResult:
    """Nothing ran: say what is held and how a person runs it, since this client cannot be asked here."""
    pairs = " ".join(shlex.quote(f"{k}:={_json(v)}" if not isinstance(v, str) else f"{k}={v}")
                     for k, v in arguments.items())
    text = (f"{result.error or 'held for approval'}\nNothing was run: this call needs a person's "
            f"approval. A person can run it in a terminal with `tether exec {shlex.quote(name)} {pairs} --approve` "
            "(same config and policy), or allow it in the policy file.")
    structured = result.result if isinstance(result.result, dict) else None
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)],
                                    structured_content=structured, is_error=True)


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _error(text: str) -> mcp_types.CallToolResult:
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)], is_error=True)
