"""`POST /api/v1/transfers`: send a file or directory from one device to another (docs/transfer.md).

The caller's token must hold `execute` and reach both devices; the receiver journals the write into the
caller's session (its own default, or one it owns), so undoing that session on the receiving device puts
the destination back. `approve: true` is a person's approval (a token with the `approve` scope, never an
agent's) for a destination the receiver's policy reserves for a person; it may carry the
`approval_digest` the refusal showed. The answer is the transfer's `Result` (200 whether it succeeded or
not, like a batch's results); a request that cannot start (scope, session, unknown device) is a 4xx
`{"error"}`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.models import Result
from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.transfer.model import Caller, TransferRequest
from tether.server.aip.transfer.service import TransferService
from tether.server.http.api import ERROR_RESPONSES, _reachable, refuse_unaudited, require, require_approver
from tether.server.store.tokens import TokenInfo
from tether.server.trust.approvals import how_a_person_approves
from tether.server.trust.sessions import owned_session

transfer_router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES, tags=["transfers"])


class TransferBody(BaseModel):
    """A transfer: `source_path` on `source` to `dest_path` on `dest`."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(..., min_length=1, max_length=128, description="the sending device")
    source_path: str = Field(..., min_length=1, max_length=4096, description="a file or directory there")
    dest: str = Field(..., min_length=1, max_length=128, description="the receiving device")
    dest_path: str = Field(..., min_length=1, max_length=4096, description=(
        "where it goes; an existing directory receives it by its name, as cp does"))
    overwrite: bool = Field(False, description="replace existing files (outside the temp dir a person approves)")
    max_bytes: int | None = Field(None, ge=1, description="a lower cap than the server's transfer_max_bytes")
    chunk_bytes: int | None = Field(None, ge=4096, description="smaller chunks than the server's")
    session_id: str | None = Field(None, description="the undo session the receiver journals into")
    approve: bool = Field(False, description="a person's approval for what the receiver reserves for a person")
    approval_digest: str | None = Field(None, description="the digest the needs-approval answer showed")


@transfer_router.post("/transfers", response_model=Result)
async def create_transfer(body: TransferBody, request: Request,
                          who: Annotated[TokenInfo, Depends(require("execute"))]) -> Any:
    """Run the transfer and answer with its `Result` once it ends (see the module)."""
    hub = request.app.state.hub
    registry = request.app.state.registry
    store = request.app.state.store
    for name in (body.source, body.dest):
        await _reachable(hub, registry, name, who)
    refuse_unaudited(store)
    approved_by = None
    if body.approve:
        require_approver(who, "approve a transfer", how_a_person_approves(str(request.base_url), device=body.dest),
                         requested_by=f"api:{who.name}", settings=request.app.state.settings)
        approved_by = f"api:{who.name}"
    session = await owned_session(store, body.dest, body.session_id, [], who)
    service: TransferService = request.app.state.transfers
    caller = Caller(requested_by=f"api:{who.name}", session_id=session, approved_by=approved_by,
                    approval_digest=body.approval_digest if approved_by else None, asker=TokenRef.of(who))
    return await service.transfer(TransferRequest(body.source, body.source_path, body.dest, body.dest_path,
                                                  overwrite=body.overwrite, max_bytes=body.max_bytes,
                                                  chunk_bytes=body.chunk_bytes), caller)
