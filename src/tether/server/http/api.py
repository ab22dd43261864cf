"""The REST API's shared parts: its error body, the scope checks every route depends on, and the views of a
device; the routes themselves are in `tether.server.http.routes`.

Bearer tokens in the `Authorization` header carry scopes: `read` (look), `execute` (run
commands), `admin` (tokens and audit; implies the others). Every error body is
`{"error": "<what is wrong>"}` so a script can show it as is.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, HTTPException, Request
from pydantic import BaseModel, Field

from tether.protocol.models import Command
from tether.protocol.profile import DeviceProfile
from tether.server.aip.fleet.record import DeviceRecord
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.fleet.scopes import reaches, unknown_device
from tether.server.aip.hub import DeviceHub
from tether.server.ports import BackplaneUnavailable
from tether.server.store import Store
from tether.server.store.tokens import AGENT_NEVER, TokenInfo
from tether.server.trust.approvals import ApprovalRefused, check_approver, check_four_eyes, how_a_person_approves
from tether.server.trust.oidc.bearer import OidcRefused


class ErrorBody(BaseModel):
    """The body of every error answer: what is wrong, in words a script can show as is."""

    error: str


# Documented for every route, so the OpenAPI document says what 401/403/404/409/413/422 look like
# (a "4XX" entry also replaces FastAPI's default 422 schema, which would promise {"detail": [...]}).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {"4XX": {"model": ErrorBody, "description": "Client Error"}}


class DeviceView(BaseModel):
    name: str
    status: str
    platform: str | None = None
    last_seen: float | None = None
    load: int = 0
    running: int = Field(0, description="batches running on the device (its last heartbeat)")
    queued: int = Field(0, description="batches the device accepted and has not started (its last heartbeat)")
    capabilities: list[str] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    gpu: bool = False
    address: str | None = None
    sandbox: str | None = None
    node: str | None = Field(None, description="in a cluster: the node holding the device's socket")


class DeviceDetail(DeviceView):
    profile: DeviceProfile | None = None


def _hub(request: Request) -> DeviceHub:
    return request.app.state.hub


def _store(request: Request) -> Store:
    return request.app.state.store


def _registry(request: Request) -> DeviceRegistry:
    return request.app.state.registry


def require(scope: str):
    """A dependency that admits an API token holding `scope` (or `admin`)."""

    async def check(request: Request, authorization: Annotated[str | None, Header()] = None) -> TokenInfo:
        return await authorize(request, authorization, scope)

    return check


async def authorize(request: Request, authorization: str | None, scope: str) -> TokenInfo:
    """The API token of this request if it holds `scope`; else the 401/403 `HTTPException` saying why. The
    token is looked up without holding up the event loop (`Tokens.check`)."""
    sessions = getattr(request.app.state, "web_sessions", None)  # the dashboard's cookie (server/web)
    if not authorization and sessions is not None and (secret := sessions.bearer_for(request)):
        authorization = f"Bearer {secret}"  # CSRF already checked; the token is checked as any other
    if not authorization or not authorization.lower().startswith("bearer "):
        raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <api token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    try:  # tether's API tokens, then the configured OIDC issuers' JWTs (server/trust/oidc)
        info = await request.app.state.bearer.check(authorization[7:].strip(), request.scope)
    except OidcRefused as exc:
        raise HTTPException(exc.status, str(exc), headers={"WWW-Authenticate": "Bearer"} if exc.status == 401
                            else None) from None
    if info is None:
        raise HTTPException(401, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"})
    if info.kind != "api":
        raise HTTPException(403, "a device token cannot use the API; create one with "
                                 "'tether token create --api'")
    if info.agent and scope == "approve":  # approving is a person's: say how a person does it
        raise HTTPException(403, f"token '{info.name}' is an agent's token, and an agent never approves or answers "
                                 f"a person's question: {how_a_person_approves(str(request.base_url))}")
    if info.agent and scope in AGENT_NEVER:
        raise HTTPException(403, f"token '{info.name}' is an agent's token, which never holds the '{scope}' scope "
                                 "(an admin could make itself a person's token); ask a person with an admin token")
    if not info.allows(scope):
        raise HTTPException(403, f"token '{info.name}' lacks the '{scope}' scope (has {info.scopes})")
    return info


def _view(record: DeviceRecord, detail: bool = False, here: str | None = None) -> DeviceView:
    profile = record.profile
    data: dict[str, Any] = {
        "name": record.name, "status": record.status, "last_seen": record.last_seen, "load": record.load,
        "running": max(record.running - record.queued, 0), "queued": record.queued,
        "platform": profile.os.platform if profile else None,
        "capabilities": profile.capabilities if profile else [],
        "tags": profile.tags if profile else [], "gpu": bool(profile and profile.gpu.available),
        "address": getattr(record, "address", None), "sandbox": profile.sandbox if profile else None,
        "node": record.node or (here if record.connected else None),
    }
    return DeviceDetail(**data, profile=profile) if detail else DeviceView(**data)


def _record(registry: DeviceRegistry, name: str, who: TokenInfo | None = None) -> DeviceRecord:
    """The device's record; 404 when none registered, or when `who` is a token whose scope leaves it out."""
    record = registry.get(name)
    if who is not None and who.scoped and (record is None or not who.reaches(name, record.tags)):
        raise HTTPException(404, unknown_device(who, name))
    if record is None:
        raise HTTPException(404, f"no device named '{name}'")
    return record


def in_scope(registry: DeviceRegistry, who: TokenInfo, name: str) -> None:
    """404 `{"error"}` naming the scope unless `who` reaches the device (known or not yet known here)."""
    if not reaches(who, registry, name):
        raise HTTPException(404, unknown_device(who, name))


async def _reachable(hub: DeviceHub, registry: DeviceRegistry, name: str, who: TokenInfo | None = None) -> None:
    """404 for a device no node knows (or outside `who`'s scope); in a cluster, 503 while the backplane is
    away for a device whose socket is not here (where it is cannot be known, and guessing would diverge)."""
    if who is not None:
        in_scope(registry, who, name)
    if hub.remote is None or hub.holds(name):
        _record(registry, name)
        return
    # unknown here: registered on another node a moment ago (a known one with the backplane away: `commands._run` 503s)
    if registry.get(name) is None:
        try:
            holder = await hub.remote.holder(name)
        except BackplaneUnavailable as exc:
            raise HTTPException(503, str(exc), headers={"Retry-After": "5"}) from None
        if holder is None:
            raise HTTPException(404, f"no device named '{name}'")
        registry.held_elsewhere(name, holder)


def require_approver(who: TokenInfo, what: str, how: str | None = None, *, requested_by: str | None = None,
                     settings: Any = None) -> None:
    """403 `{"error"}` unless `who` may approve: a person's token (never an agent's) holding `approve`, and,
    with the server's `four_eyes` on (`settings`), not the token that asked (`requested_by`). `how` says how
    a person approves instead (`approvals.how_a_person_approves`)."""
    try:
        check_approver(who, what, how or how_a_person_approves(None))
        check_four_eyes(bool(getattr(settings, "four_eyes", False)), requested_by, f"api:{who.name}", what)
    except ApprovalRefused as exc:
        raise HTTPException(exc.status, str(exc)) from None


def stamp_approvals(commands: list[Command], who: TokenInfo, request: Request | None = None,
                    device: str | None = None) -> None:
    """A command sent as approved is approved by the caller, who must be a person holding the `approve`
    scope (with four-eyes on, never: the sender asked for it); the audit log names the token, whatever
    name the caller wrote. Its `approval_digest` (what the person was shown) goes on to the device."""
    if not any(c.approved_by for c in commands):
        return
    first = next(c for c in commands if c.approved_by)
    base = str(request.base_url) if request is not None else None
    settings = getattr(request.app.state, "settings", None) if request is not None else None
    require_approver(who, "send commands marked approved",
                     how_a_person_approves(base, device=device, tool=first.tool_name),
                     requested_by=f"api:{who.name}", settings=settings)
    for command in commands:
        if command.approved_by:
            command.approved_by = f"api:{who.name}"


def refuse_unaudited(store: Store) -> None:
    """503 `{"error": …}` before anything is sent while the audit log cannot be written (a full or
    read-only disk): a command that cannot be audited is not run."""
    problem = store.audit.problem()
    if problem is not None:
        raise HTTPException(503, f"refused, nothing was run: {problem}", headers={"Retry-After": "5"})


def require_fleet(scope: str):
    """A dependency that admits an API token holding `scope` and reaching every device: what acts on the
    whole fleet's keys (tokens) must not be open to a token scoped to some devices, which could otherwise
    make itself an unscoped one."""

    async def check(request: Request, authorization: Annotated[str | None, Header()] = None) -> TokenInfo:
        who = await authorize(request, authorization, scope)
        if who.scoped:
            raise HTTPException(403, f"token '{who.name}' is scoped to some devices ({who.scope_text()}); "
                                     "this needs a token that reaches every device")
        return who

    return check
