"""The approval inbox (docs/approvals.md): `GET /api/v1/approvals` lists what waits for a person that the
caller's token may answer — tasks waiting on an approval, a plan to confirm or a question, and questions
external MCP servers asked during a command — across devices and tasks; `GET /api/v1/approvals/events`
pushes its count and ids whenever they change (the dashboard's badge), as server-sent events.

An item's `id` is the task's id for a task, `DEVICE/QUESTION` for a device's question; answers go through
the routes that decide them (`/tasks/{id}/approval`, `/tasks/{id}/answer`,
`/devices/{name}/questions/{id}`), which check again. `tether approvals` is the CLI over these.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from tether.agent.run.replies import APPROVAL_KINDS
from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.service import TaskService
from tether.server.http.api import ERROR_RESPONSES, require
from tether.server.store.tokens import TokenInfo
from tether.server.trust.approvals import token_of

inbox_router = APIRouter(prefix="/api/v1/approvals", responses=ERROR_RESPONSES, tags=["approvals"])
KEEPALIVE_S = 15.0
MAX_ITEMS = 1000


async def _task_items(service: TaskService, who: TokenInfo, four_eyes: bool) -> list[dict[str, Any]]:
    items = []
    for row in await service.listing(MAX_ITEMS, "waiting_for_user"):
        with contextlib.suppress(TaskError):
            task = await service.fetch(row["id"])
            pending = task.pending_question
            if pending is None or not service.visible(task, who) or not service.asked(task, pending.id):
                continue
            approval = pending.kind in APPROVAL_KINDS
            mine = token_of(task.requested_by or "") == f"api:{who.name}"
            if approval and (who.agent or not who.allows("approve") or (four_eyes and mine)):
                continue
            if not approval and not who.allows("execute"):
                continue
            items.append({"id": task.id, "source": "task", "kind": pending.kind, "task": task.id,
                          "device": task.device, "question": pending.question, "options": pending.options,
                          "question_id": pending.id, "digest": pending.digest, "changes": len(pending.changes),
                          "request": task.request, "requested_by": task.requested_by,
                          "asked_at": task.updated_at.timestamp()})
    return items


def _device_items(request: Request, who: TokenInfo, four_eyes: bool) -> list[dict[str, Any]]:
    hub = request.app.state.hub
    if who.agent or not who.allows("approve"):  # answering a device's question takes `approve` (its route)
        return []
    items = []
    for q in hub.open_questions():
        record = hub.registry.get(q["device"])
        if not who.reaches(q["device"], record.tags if record is not None else ()):
            continue
        own = q.get("asker") == who.name
        if (q["approval"] and four_eyes and own) or not (own or q.get("asker") is None or q.get("asker_agent")
                                                         or (four_eyes and q["approval"])):
            continue  # as `approvals.check_answerer` decides
        fields = (q.get("schema") or {}).get("properties") or {}
        options = next((list(p.get("enum") or []) for p in fields.values() if isinstance(p, dict)), [])
        items.append({"id": f"{q['device']}/{q['id']}", "source": "device",
                      "kind": "approval" if q["approval"] else "question", "task": None, "device": q["device"],
                      "question": q["message"], "options": [str(o) for o in options], "question_id": q["id"],
                      "server": q.get("server"), "schema": q.get("schema"), "requested_by": q.get("asker"),
                      "asked_at": q["at"]})
    return items


async def inbox(request: Request, who: TokenInfo) -> list[dict[str, Any]]:
    """What waits for a person that `who` may answer, oldest first (see the module docstring). The tasks'
    table is read without holding up the event loop (`TaskService.listing`)."""
    four_eyes = bool(getattr(request.app.state.settings, "four_eyes", False))
    service: TaskService | None = getattr(request.app.state, "tasks", None)
    items = await _task_items(service, who, four_eyes) if service is not None else []
    items += _device_items(request, who, four_eyes)
    return sorted(items, key=lambda item: item["asked_at"])


@inbox_router.get("")
async def list_approvals(request: Request, who: Annotated[TokenInfo, Depends(require("read"))]
                         ) -> list[dict[str, Any]]:
    """The caller's inbox: id, source (task | device), kind (approval | confirmation | question), task, device,
    question, options, question_id, digest, requested_by, asked_at (Unix seconds)."""
    return await inbox(request, who)


# an endless stream, as the dashboard's /web/fleet: kept out of the OpenAPI document (docs/approvals.md has it)
@inbox_router.get("/events", include_in_schema=False)
async def approval_events(request: Request, who: Annotated[TokenInfo, Depends(require("read"))]
                          ) -> StreamingResponse:
    """Server-sent `approvals` events, `{"count", "ids"}`: one at once, then one whenever the inbox changes."""
    return StreamingResponse(_follow(request, who), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _follow(request: Request, who: TokenInfo) -> AsyncIterator[bytes]:
    changes = request.app.state.notifier.changes
    seen, shown = -1, None
    while not changes.closed:
        version = changes.version
        ids = [item["id"] for item in await inbox(request, who)]
        if ids != shown:
            shown = ids
            yield f"event: approvals\ndata: {json.dumps({'count': len(ids), 'ids': ids})}\n\n".encode()
        seen = version
        if await changes.wait(seen, KEEPALIVE_S) == seen and not changes.closed:
            yield b": keep-alive\n\n"  # proxies drop silent streams
