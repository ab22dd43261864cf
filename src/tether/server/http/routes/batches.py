"""`GET /api/v1/batches/{id}`: a batch's record — what each of its commands became, also when that
came after its caller's wait ended (docs/outcomes.md).

The record is the audit log's rows of the batch (they exist before a command is sent, and its outcome
is written into them whenever it comes: `AuditLog.late`), plus whether the batch is still in flight
on this node. A token sees the batches it started (and those of its tasks); `admin` sees every batch;
a token scoped to devices sees only batches of devices it reaches, and is told the same 404 for one
outside its scope as for one that does not exist.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Request

from tether.server.aip.fleet.scopes import reaches
from tether.server.http.api import ERROR_RESPONSES, _hub, _registry, _store, require
from tether.server.store.audit import LATE_NOTE, PENDING, SENT, UNKNOWN
from tether.server.store.tokens import TokenInfo

batch_router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES)

OPEN = (SENT, PENDING, UNKNOWN)  # audit statuses of a command whose outcome is not known (yet)


def _owns(who: TokenInfo, requested_by: str) -> bool:
    """Whether `requested_by` (an audit row's) is `who`: its own batches, and its tasks' and undos'."""
    me = f"api:{who.name}"
    return requested_by == me or requested_by.endswith((f" for {me}", f" by {me}"))


def batch_record(response_id: str, rows: list[dict[str, Any]], in_flight: bool) -> dict[str, Any]:
    """The body of `GET /batches/{id}` from the batch's audit rows (oldest first)."""
    commands = [{"call_id": r["call_id"], "tool_name": r["tool_name"], "status": r["status"], "error": r["error"],
                 "late": bool(r["error"] and r["error"].startswith(LATE_NOTE)), "at": r["at"]} for r in rows]
    open_ = [c for c in commands if c["status"] in OPEN]
    state = "running" if in_flight else ("pending" if open_ else "done")
    return {"batch_id": response_id, "device": rows[0]["device"], "requested_by": rows[0]["requested_by"],
            "state": state, "commands": commands,
            "note": {"running": "the caller still waits for this batch",
                     "pending": "the outcome of some commands is not known yet: the device may still be running "
                                "them, and each is recorded here when it comes back",
                     "done": "every command's outcome is recorded"}[state]}


@batch_router.get("/batches/{response_id}")
async def get_batch(request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
                    response_id: Annotated[str, Path(min_length=1, max_length=64)]) -> dict[str, Any]:
    """A batch's record: its device, who asked, and each command's status (`sent`, `pending`, `unknown`
    while its outcome is open; `late` when it came after the caller's wait ended)."""
    rows = await _store(request).audit.read_batch(response_id)
    if rows and (not (who.allows("admin") or _owns(who, rows[0]["requested_by"]))
                 or not reaches(who, _registry(request), rows[0]["device"])):
        rows = []  # not this token's to see: the same answer as for no such batch
    if not rows:
        raise HTTPException(404, f"no batch '{response_id[:64]}' of token '{who.name}' in the audit log "
                                 "(a batch's record is kept among the newest audit rows; see the audit log)")
    return batch_record(response_id, rows, _hub(request).pending(response_id) is not None)
