"""What the `admin` scope reaches: the API tokens (`/api/v1/tokens`: list, create, revoke) and the audit log
(`GET /api/v1/audit`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.identity import fingerprint
from tether.server.aip.fleet.scopes import reached_names
from tether.server.http.api import ERROR_RESPONSES, _hub, _registry, _store, in_scope, require, require_fleet
from tether.server.store import Store
from tether.server.store.tokens import SCOPE_DEVICE, SCOPE_TAG, TokenInfo
from tether.server.trust.device_keys import device_key, parse_public_key, set_device_key

router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES)


class TokenRequest(BaseModel):
    # scopes (and device/tag scopes) are for API tokens; a device token has none (said in the document too)
    # and only an API token is an agent's, which holds neither approve nor admin (docs/security/approvals.md)
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"properties": {"kind": {"const": "api"}}},
        {"properties": {"scopes": {"maxItems": 0}, "devices": {"maxItems": 0}, "tags": {"maxItems": 0}}}], "allOf": [
        {"anyOf": [{"properties": {"kind": {"const": "api"}}}, {"properties": {"agent": {"const": False}}}]},
        {"anyOf": [{"properties": {"agent": {"const": False}}},
                   {"properties": {"scopes": {"items": {"enum": ["read", "execute"]}}}}]},
        {"anyOf": [{"properties": {"kind": {"const": "device"}}}, {"properties": {"public_key": {"const": None}}}]}]})

    kind: Literal["device", "api"]
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
    scopes: list[Literal["read", "execute", "approve", "admin", "sample"]] = Field(default_factory=list)
    devices: list[Annotated[str, Field(pattern=SCOPE_DEVICE.pattern)]] = Field(
        default_factory=list, max_length=100, description="an API token: the devices it reaches (names or globs); "
                                                          "none = all")
    tags: list[Annotated[str, Field(pattern=SCOPE_TAG.pattern)]] = Field(
        default_factory=list, max_length=100, description="an API token: it also reaches the devices with one of "
                                                          "these tags")
    agent: bool = Field(False, description="an agent's API token: it may read and run, never approve (no approve "
                                           "or admin scope); `tether mcp config` makes these")
    public_key: str | None = Field(None, max_length=1000, description=(
        "a device token: the device's Ed25519 public key (as `tether device key` prints it, or PEM), enrolled "
        "now instead of at its first registration; a device whose key is enrolled already must be given that "
        "key (another one is `tether token rotate --device NAME --key ...`)"))


class TokenCreated(BaseModel):
    token: str
    info: dict[str, Any]


@router.get("/tokens")
async def list_tokens(request: Request,
                      _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> list[dict[str, Any]]:
    store = _store(request)
    return [_token_dict(t) for t in await store.call(store.tokens.all)]


@router.post("/tokens", response_model=TokenCreated, status_code=201)
async def create_token(body: TokenRequest, request: Request,
                       _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> TokenCreated:
    """Create a token (its secret is in the answer only). A device token may carry the device's
    `public_key`, enrolled with it (`device_keys.parse_public_key` reads it; 400 when malformed, 409 when
    the device has another key already): from then on only a registration proving that key is accepted.
    Its statements run off the event loop (`Store.call`)."""
    store = _store(request)
    return await store.call(_create_token, store, body)


def _create_token(store: Store, body: TokenRequest) -> TokenCreated:
    key: str | None = None
    if body.public_key is not None:
        if body.kind != "device":
            raise HTTPException(400, "public_key is a device's key: give it with kind 'device'")
        try:
            key = parse_public_key(body.public_key)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        enrolled = device_key(store, body.name)
        if enrolled is not None and enrolled.public_key != key:
            raise HTTPException(409, f"device '{body.name}' has another key (enrolled by {enrolled.enrolled_by}); "
                                     f"to give it a new key use: tether token rotate --device {body.name} "
                                     "--key PUBLIC_KEY")
    try:
        info, secret = store.tokens.create(body.kind, body.name, body.scopes, devices=body.devices,
                                           tags=body.tags, agent=body.agent)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    if key is not None and device_key(store, body.name) is None:
        set_device_key(store, body.name, key, "admin")
    info_dict = _token_dict(info)
    if body.kind == "device":
        enrolled = device_key(store, body.name)
        info_dict["key_fingerprint"] = fingerprint(enrolled.public_key) if enrolled is not None else None
    return TokenCreated(token=secret, info=info_dict)


@router.delete("/tokens/{token}")
async def revoke_token(token: str, request: Request,
                       _: Annotated[TokenInfo, Depends(require_fleet("admin"))]) -> dict[str, Any]:
    count = await _hub(request).revoke_token(token)  # also drops a connected device at once
    if not count:
        raise HTTPException(404, f"no active token '{token}'")
    return {"revoked": count}


@router.get("/audit")
async def audit(request: Request, who: Annotated[TokenInfo, Depends(require("admin"))],
                limit: Annotated[int, Query(ge=1, description="rows per page, at most 500")] = 100,
                device: str | None = None, task: str | None = None, token: str | None = None,
                since: float | None = None, until: float | None = None,
                before: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None) -> dict[str, Any]:
    """Audit rows newest first, filtered server-side; `next` is the `before` of the following page
    (null on the last one). `token` is an API token's name, `task` an id or prefix, times unix seconds."""
    limit = max(1, min(limit, 500))
    devices = None
    if who.scoped:  # a scoped admin reads the rows of the devices it reaches, and no others
        if device is not None:
            in_scope(_registry(request), who, device)
        devices = reached_names(who, _hub(request).registry) or []
    rows = await _store(request).audit.read_rows(limit=limit + 1, device=device, task=task, token=token,
                                                 since=since, until=until, before=before, devices=devices)
    more = len(rows) > limit
    rows = rows[:limit]
    return {"rows": rows, "next": rows[-1]["id"] if more else None}


def _token_dict(info: TokenInfo) -> dict[str, Any]:
    return info.model_dump(mode="json") if hasattr(info, "model_dump") else dict(vars(info))
