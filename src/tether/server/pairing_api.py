"""REST routes of pairing (see `tether.server.pairing`): two for a device that has no token yet, three
for an admin. The device's two carry no credential, so they are rate-limited per address, capped in
body size by the request guard, and can do nothing but wait for a person's decision."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from tether.server.api import ERROR_RESPONSES, require_fleet
from tether.server.pairing import PairingBook, PairingError
from tether.server.ratelimit import claim_refusal
from tether.server.store import TokenInfo

pairing_router = APIRouter(prefix="/api/v1/pairing", responses=ERROR_RESPONSES, tags=["pairing"])


class PairingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint: str = Field(..., pattern="^[0-9a-fA-F]{64}$", description="SHA-256 (hex) of the key the device keeps")
    name: str | None = Field(None, max_length=128, description="the name the device would like")
    platform: str | None = Field(None, max_length=64)


class PairingClaim(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str = Field(..., min_length=32, max_length=256, description="the key whose fingerprint was sent")
    wait: float = Field(25.0, ge=0, le=60, description="seconds to wait for a decision before answering pending")


class PairingDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$",
                             description="the device's name (default: the one it asked for)")
    tags: list[str] = Field(default_factory=list, max_length=32)


def _book(request: Request) -> PairingBook:
    book = getattr(request.app.state, "pairing", None)
    if book is None:
        raise HTTPException(404, "pairing is switched off on this server (pairing: false)")
    return book


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except PairingError as exc:
        raise HTTPException(exc.status, str(exc)) from None


@pairing_router.post("", status_code=201)
async def request_pairing(body: PairingRequest, request: Request) -> dict[str, Any]:
    """A device without a token asks to be let in; it gets a code to show."""
    address = request.client.host if request.client else "unknown"
    return _call(_book(request).request, body.fingerprint, address, body.name, body.platform)


@pairing_router.post("/{code}/claim")
async def claim_pairing(code: str, body: PairingClaim, request: Request) -> dict[str, Any]:
    """The device's token once an admin approved its code (waits up to `wait` s for the decision)."""
    try:
        return await _book(request).claim(code, body.key, body.wait)
    except PairingError as exc:
        status, error = claim_refusal(exc.status, str(exc))  # an unknown code and a wrong key: one answer
        raise HTTPException(status, error) from None


@pairing_router.get("")
async def pending_pairings(request: Request,
                           _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> list[dict[str, Any]]:
    return _book(request).pending()


@pairing_router.post("/{code}/approve")
async def approve_pairing(code: str, body: PairingDecision, request: Request,
                          who: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    return _call(_book(request).approve, code, body.name, body.tags, who.name)


@pairing_router.post("/{code}/refuse")
async def refuse_pairing(code: str, request: Request,
                         who: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    return _call(_book(request).refuse, code, who.name)
