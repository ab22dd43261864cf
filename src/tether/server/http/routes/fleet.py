"""`POST /api/v1/fleet/commands`: one batch to every device that meets `requires` (server/aip/batches/fanout.py).

The answer streams per-device lines as they arrive — NDJSON with `Accept: application/x-ndjson`, SSE
with `Accept: text/event-stream` — and ends with a summary line; any other Accept gets one JSON body
at the end. The first line (SSE event `fanout`) carries the fan-out's id and how many devices it
reaches, so a progress bar knows its total and `DELETE /api/v1/fleet/commands/{id}` can stop it. A
caller that goes away cancels the fan-out, and with it the batches still running on devices.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.models import Command
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.batches.fanout import (
    DEFAULT_CONCURRENCY,
    MAX_CONCURRENCY,
    DeviceOutcome,
    FanOut,
    FanOutError,
    countable,
)
from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.fleet.scopes import beyond, reaches, within
from tether.server.http.api import ERROR_RESPONSES, refuse_unaudited, require, stamp_approvals
from tether.server.store.tokens import TokenInfo

FANOUT_HEADER = "X-Tether-Fanout"
NDJSON = "application/x-ndjson"
SSE = "text/event-stream"

fleet_router = APIRouter(prefix="/api/v1/fleet", responses=ERROR_RESPONSES)


class FleetBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requires: DeviceRequirements = Field(default_factory=DeviceRequirements)
    commands: list[Command] = Field(..., min_length=1, max_length=100)
    max_concurrency: int = Field(DEFAULT_CONCURRENCY, ge=1, le=MAX_CONCURRENCY,
                                 description="batches in flight at once")
    timeout: float = Field(60.0, gt=0, le=24 * 3600, description="for the whole fan-out; stragglers end timed_out")
    early_exit: bool = True


def mount_fleet(app: FastAPI) -> None:
    """Add the fan-out routes and the book of running fan-outs (for DELETE) to the app."""
    app.state.fanouts = {}
    app.include_router(fleet_router)


def _fanouts(request: Request) -> dict[str, FanOut]:
    return request.app.state.fanouts


def _capped(outcome: DeviceOutcome, limit: int) -> bytes:
    """The outcome's JSON line, at most about `limit` bytes: past it the results give way to an error
    saying how large they were (the audit log still has each command's outcome)."""
    body = json.dumps(outcome.line(), default=str, separators=(",", ":")).encode()
    if len(body) <= limit:
        return body
    short = DeviceOutcome(outcome.device, outcome.status, error=(
        f"results too large for one line: {len(body)} bytes, and the limit is {limit} bytes (max_response_bytes); "
        f"the batch ended '{outcome.status}' on the device (see the audit log)"), duration=outcome.duration)
    return json.dumps(short.line(), separators=(",", ":")).encode()


@fleet_router.post("/commands", responses={200: {"content": {NDJSON: {}, SSE: {}}}})
async def fleet_commands(batch: FleetBatch, request: Request,
                         who: Annotated[TokenInfo, Depends(require("execute"))]) -> Any:
    """Run the batch on every device meeting `requires`, at most `max_concurrency` at once. Each
    device's line is `{device, status: ok|failed|offline|timed_out|cancelled, results|error, duration}`;
    the last is `{summary: {ok, failed, offline, timed_out, cancelled, total, duration}}`. A token scoped
    to some devices reaches only those: the others are not selected, whatever `requires` says."""
    stamp_approvals(batch.commands, who, request)
    hub = request.app.state.hub
    store = request.app.state.store
    refuse_unaudited(store)
    active = await store.call(store.tokens.active_device_names)  # off the event loop (PostgreSQL)
    try:
        fan = FanOut(hub, request.app.state.registry, batch.requires, batch.commands,
                     max_concurrency=batch.max_concurrency,
                     timeout=batch.timeout, early_exit=batch.early_exit, requested_by=f"api:{who.name}",
                     within=countable(active, within(who)),
                     asker=TokenRef.of(who))
    except FanOutError as exc:
        raise HTTPException(exc.status, str(exc) + (beyond(who) if exc.status == 404 else "")) from None
    accept = request.headers.get("accept", "")
    kind = SSE if SSE in accept else NDJSON if NDJSON in accept else "application/json"
    headers = {FANOUT_HEADER: fan.id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_stream(request, fan, kind, hub.settings.max_response_bytes), media_type=kind,
                             headers=headers)


async def _stream(request: Request, fan: FanOut, kind: str, limit: int) -> AsyncIterator[bytes]:
    book = _fanouts(request)
    book[fan.id] = fan
    head = {"fanout": {"id": fan.id, "total": len(fan.devices)}}
    try:
        if kind == SSE:
            yield f"event: fanout\ndata: {json.dumps(head['fanout'])}\n\n".encode()
            async for outcome in fan.outcomes():
                yield b"event: device\ndata: " + _capped(outcome, limit) + b"\n\n"
            yield f"event: summary\ndata: {json.dumps({'summary': fan.summary()})}\n\n".encode()
        elif kind == NDJSON:
            yield json.dumps(head).encode() + b"\n"
            async for outcome in fan.outcomes():
                yield _capped(outcome, limit) + b"\n"
            yield json.dumps({"summary": fan.summary()}).encode() + b"\n"
        else:  # one body at the end, streamed so that a caller who leaves meanwhile is noticed
            lines = [_capped(outcome, limit) async for outcome in fan.outcomes()]
            yield (b'{"fanout":' + json.dumps(fan.id).encode() + b',"devices":[' + b",".join(lines)
                   + b'],"summary":' + json.dumps(fan.summary()).encode() + b"}")
    finally:
        book.pop(fan.id, None)


@fleet_router.delete("/commands/{fanout_id}")
async def cancel_fleet_commands(fanout_id: str, request: Request,
                                who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Cancel a running fan-out: batches in flight are cancelled on their devices (`cancelled`), the
    devices not reached yet are never sent the batch (`cancelled` too); the stream ends with its summary."""
    fan = _fanouts(request).get(fanout_id)
    registry = request.app.state.registry
    if fan is None or (who.scoped and not all(reaches(who, registry, d) for d in fan.devices)):
        raise HTTPException(404, f"no fan-out '{fanout_id}' is running" + (
            f" on devices in the scope of token '{who.name}' ({who.scope_text()})" if who.scoped else ""))
    fan.cancel(f"cancelled by api:{who.name} (DELETE /api/v1/fleet/commands/{fanout_id})")
    return {"cancelled": fanout_id}
