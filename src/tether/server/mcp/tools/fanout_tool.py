"""`run_on_fleet`: one tool call on every device meeting requirements, for an MCP client (the same
fan-out engine as `POST /api/v1/fleet/commands`, `tether.server.aip.batches.fanout`).

Each device's outcome reaches the client as a progress notification while the fan-out runs; the
answer is every device's line and the summary. The client's cancellation ends the fan-out: batches in
flight are cancelled on their devices and the rest are never sent. Listed with the fleet tools, so a
client filtered to a few devices (`?devices=`) still has it; `requires` is what chooses its devices.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from tether.protocol.models import Command
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.batches.fanout import DEFAULT_CONCURRENCY, MAX_CONCURRENCY, FanOut, FanOutError, countable
from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.fleet.scopes import beyond, within
from tether.server.aip.hub import DeviceHub
from tether.server.mcp.contributed import GatewayCall, GatewayReply, GatewayTool

MAX_TIMEOUT_S = 24 * 3600.0

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool": {"type": "string", "description": "the device tool to call on each device, e.g. shell.run"},
        "arguments": {"type": "object", "description": "its arguments, the same for every device"},
        "requires": {"type": "object", "description": "which devices: name, platform, tags, gpu, tools "
                                                      "(empty: every device)",
                     "properties": {"name": {"type": "string"}, "platform": {"type": "string"},
                                    "tags": {"type": "array", "items": {"type": "string"}},
                                    "gpu": {"type": "boolean"},
                                    "tools": {"type": "array", "items": {"type": "string"}}},
                     "additionalProperties": False},
        "max_concurrency": {"type": "integer", "minimum": 1, "maximum": MAX_CONCURRENCY,
                            "default": DEFAULT_CONCURRENCY},
        "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_S, "default": 60,
                    "description": "seconds for the whole fan-out; devices still running then end timed_out"},
    },
    "required": ["tool"],
    "additionalProperties": False,
}

OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "devices": {"type": "array", "items": {"type": "object"}},
        "summary": {"type": "object", "properties": {k: {"type": "number"} for k in (
            "ok", "failed", "offline", "timed_out", "cancelled", "total", "duration")}},
    },
    "required": ["devices", "summary"],
}


def fan_out_tool(hub: DeviceHub, registry: DeviceRegistry) -> GatewayTool:
    async def run(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        active = await hub.store.call(hub.store.tokens.active_device_names)  # off the event loop (PostgreSQL)
        try:
            requires = DeviceRequirements.model_validate(arguments.get("requires") or {})
            command = Command(tool_name=str(arguments.get("tool") or ""), parameters=arguments.get("arguments") or {})
            timeout = float(arguments.get("timeout", 60))
            if not command.tool_name or not 0 < timeout <= MAX_TIMEOUT_S:
                raise ValueError("give a tool, and a timeout between 0 and 86400 seconds")
            fan = FanOut(hub, registry, requires, [command], max_concurrency=int(arguments.get("max_concurrency",
                                                                                     DEFAULT_CONCURRENCY)),
                         timeout=timeout, requested_by=f"mcp:{call.client} by api:{call.token.name}",
                         # a scoped token's fan-out reaches its devices only; revoked ones are not counted
                         within=countable(active, within(call.token)),
                         asker=TokenRef.of(call.token))
        except (ValidationError, ValueError, TypeError) as exc:
            status = exc.status if isinstance(exc, FanOutError) else 422
            scope = beyond(call.token) if status == 404 else ""
            return GatewayReply(f"run_on_fleet: {exc if status != 422 else _short(exc)}{scope}", is_error=True)
        lines: list[dict[str, Any]] = []
        total = len(fan.devices)
        async for outcome in fan.outcomes():  # leaving early (the client cancelled) cancels the rest
            lines.append(outcome.line())
            await call.progress(len(lines), total, f"{outcome.device}: {outcome.status}"
                                                   + (f" ({outcome.error[:200]})" if outcome.error else ""))
        summary = fan.summary()
        body = {"devices": lines, "summary": summary}
        text = (f"{summary['ok']} of {summary['total']} devices ok, {summary['failed']} failed, "
                f"{summary['offline']} offline, {summary['timed_out']} timed out, {summary['cancelled']} cancelled\n"
                + json.dumps(body, ensure_ascii=False, default=str))
        return GatewayReply(text, body, is_error=summary["ok"] < summary["total"])

    return GatewayTool(
        name="run_on_fleet",
        description="Call one device tool on every device meeting `requires`, at most max_concurrency at once; "
                    "each device's outcome arrives as progress, then every device's result and a summary.",
        input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA, scope="execute", handler=run, destructive=True)


def _short(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5])
    return str(exc)
