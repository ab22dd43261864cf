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
import shlex
from typing import TYPE_CHECKING, Any

import mcp_types
from mcp.server import Server
from mcp.server.context import ServerRequestContext

from tether import __version__
from tether.protocol.models import Command, Result, ToolInfo
from tether.tools.mcp_export import result_to_call_result

if TYPE_CHECKING:
    from tether.device.local import LocalDevice

logger = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 10_000  # progress waiting for a slow client; past it events are dropped (the result is not)
MAX_PROGRESS_TEXT = 4000
DEFAULT_CALL_TIMEOUT = 3600.0  # a call the client gave no deadline (MCP has none): the device's own cap


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

    async def _call_tool(self, ctx: ServerRequestContext[Any],
                         params: mcp_types.CallToolRequestParams) -> mcp_types.CallToolResult:
        info = self._names.get(params.name) or (await self.tools()).get(params.name)
        if info is None:
            return _error(f"no tool named {params.name!r} on this device; list the tools again")
        # the MCP name is what the device resolves: the plain name, or namespace/name for a shadowed one
        command = Command(tool_name=params.name, parameters=dict(params.arguments or {}), tool_type=info.tool_type)
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
        if _needs_approval(result):
            return _held(params.name, dict(params.arguments or {}), result)
        return result_to_call_result(result)


async def serve_device_stdio(device: LocalDevice, session_id: str) -> None:
    """Serve on stdin/stdout until the client closes stdin."""
    from tether.tools.mcp_export import serve_stdio

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
        done = data.get("progress") if kind == "progress" and isinstance(data.get("progress"), int | float) else count
        total = data.get("total") if kind == "progress" and isinstance(data.get("total"), int | float) else None
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
