"""REST routes of pairing (see `tether.server.trust.pairing`): two for a device that has no token yet, three
for an admin. The device's two carry no credential, so they are rate-limited per address, capped in
body size by the request guard, and can do nothing but wait for a person's decision."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.identity import PUBLIC_KEY_CHARS, SIGNATURE_CHARS
from tether.protocol.names import DEVICE_NAME
from tether.server.http.api import ERROR_RESPONSES, require_fleet
from tether.server.http.ratelimit import claim_refusal
from tether.server.store.tokens import TokenInfo
from tether.server.trust.pairing import PairingBook, PairingError

pairing_router = APIRouter(prefix="/api/v1/pairing", responses=ERROR_RESPONSES, tags=["pairing"])


class PairingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    public_key: str = Field(..., min_length=PUBLIC_KEY_CHARS, max_length=PUBLIC_KEY_CHARS, pattern="^[A-Za-z0-9_-]+$",
                            description="the device's Ed25519 public key (32 bytes, unpadded base64url): approving the "
                                        "request enrols it as the device")
    # the pattern documents the rule; `PairingBook` checks it and says what is wrong in words
    name: str | None = Field(None, max_length=128, description="the name the device would like",
                             json_schema_extra={"pattern": DEVICE_NAME})
    platform: str | None = Field(None, max_length=64)


class PairingClaim(BaseModel):
    model_config = ConfigDict(extra="forbid")

    signature: str = Field(..., min_length=SIGNATURE_CHARS, max_length=SIGNATURE_CHARS, pattern="^[A-Za-z0-9_-]+$",
                           description="the requesting key's Ed25519 signature of identity.claim_statement(code, "
                                       "fingerprint), unpadded base64url")
    wait: float = Field(25.0, ge=0, le=60, description="seconds to wait for a decision before answering pending")


class PairingDecision(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, max_length=256, json_schema_extra={"pattern": DEVICE_NAME}, description=(
        "the device's name (default: the one it asked for): letters, digits, '.', '_', '@' and '-', starting "
        "with a letter or digit, at most 128 characters"))
    tags: list[str] = Field(default_factory=list, max_length=32)
    replace: bool = Field(False, description="take the name of an existing device: its tokens are revoked and its "
                                             "key replaced by this request's (without it, a taken name is refused)")


def _book(request: Request) -> PairingBook:
    book = getattr(request.app.state, "pairing", None)
    if book is None:
        raise HTTPException(404, "pairing is switched off on this server (pairing: false)")
    return book


async def _call(fn: Any, *args: Any) -> Any:
    try:
        return await fn(*args)
    except PairingError as exc:
        raise HTTPException(exc.status, str(exc)) from None


@pairing_router.post("", status_code=201)
async def request_pairing(body: PairingRequest, request: Request) -> dict[str, Any]:
    """A device without a token asks to be let in; it gets a code to show, and its key's fingerprint
    (SHA-256 of the public key), which the device shows too and the admin compares."""
    address = request.client.host if request.client else "unknown"
    return await _call(_book(request).request, body.public_key, address, body.name, body.platform)


@pairing_router.post("/{code}/claim")
async def claim_pairing(code: str, body: PairingClaim, request: Request) -> dict[str, Any]:
    """The device's token once an admin approved its code (waits up to `wait` s for the decision)."""
    try:
        return await _book(request).claim(code, body.signature, body.wait)
    except PairingError as exc:
        status, error = claim_refusal(exc.status, str(exc))  # an unknown code and a wrong key: one answer
        raise HTTPException(status, error) from None


@pairing_router.get("")
async def pending_pairings(request: Request,
                           _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> list[dict[str, Any]]:
    """Open requests; `collision` says why a request's name is taken by another identity (else null)."""
    return await _book(request).pending()


@pairing_router.post("/{code}/approve")
async def approve_pairing(code: str, body: PairingDecision, request: Request,
                          who: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    done = await _call(_book(request).approve, code, body.name, body.tags, who.name, body.replace)
    if done.get("revoked_tokens"):  # the replaced device is disconnected now, not at the next token check
        await request.app.state.hub.enforce_revocations()
    return done


@pairing_router.post("/{code}/refuse")
async def refuse_pairing(code: str, request: Request,
                         who: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    return await _call(_book(request).refuse, code, who.name)
