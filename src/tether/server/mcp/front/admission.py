"""Who may use `/mcp`: the API token and device-filter checks, written without the `mcp` SDK.

The SDK is imported on the first request to `/mcp` that passes these checks (`LazyGateway`,
lazy_gateway.py): a request without a valid token is refused exactly as before, and costs the server no
import. `Gateway.__call__` runs the same checks on every request once it is built, so a revoked token
stops at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from tether.server.http.request_guard import send_error
from tether.server.mcp.front.resource_metadata import challenge
from tether.server.mcp.listing import BadFilter, DeviceFilter
from tether.server.store.tokens import TokenInfo
from tether.server.trust.oidc.bearer import Bearers, OidcRefused


@dataclass(frozen=True)
class Admitted:
    """A request's checked token and the device filter its `?devices=` asked for."""

    token: TokenInfo
    keep: DeviceFilter


@dataclass(frozen=True)
class Refused:
    """Why a request may not use `/mcp`: its HTTP status and words; `invalid_token` when it sent a token that
    is not valid, `missing_scope` when its token lacks one (both said in the `WWW-Authenticate` challenge)."""

    status: int
    error: str
    invalid_token: bool = False
    missing_scope: str | None = None


async def admit(bearer: Bearers, scope: dict[str, Any]) -> Admitted | Refused:
    """Check an HTTP request's `Authorization: Bearer` API token (scope `read`) and its `devices=` filter; the
    token is looked up without holding up the event loop (`Tokens.check`), or is a configured OIDC issuer's
    JWT (`Bearers.check`: refused 401 when it does not verify, 403 when its claims grant nothing)."""
    headers = dict(scope.get("headers") or ())
    authorization = headers.get(b"authorization", b"").decode("latin-1").strip()
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return Refused(401, "missing bearer token: send 'Authorization: Bearer <api token>'")
    try:
        token = await bearer.check(secret.strip(), scope)
    except OidcRefused as exc:
        return Refused(exc.status, str(exc), invalid_token=exc.status == 401)
    if token is None:
        return Refused(401, "unknown or revoked token", invalid_token=True)
    if token.kind != "api":
        return Refused(403, "a device token cannot use the MCP gateway; create one with "
                            "'tether token create --api NAME --scope read --scope execute'")
    if not token.allows("read"):
        return Refused(403, f"token '{token.name}' lacks the 'read' scope (has {token.scopes})", missing_scope="read")
    try:
        keep = DeviceFilter.parse(query_value(scope, "devices"))
    except BadFilter as exc:
        return Refused(400, str(exc))
    return Admitted(token, keep)


def query_value(scope: dict[str, Any], name: str) -> str | None:
    """The last value of one query parameter (`?devices=`), or None."""
    values = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True).get(name)
    return values[-1] if values else None


async def deny(scope: dict[str, Any], receive: Any, send: Any, status: int, error: str,
               refused: Refused | None = None) -> None:
    """Answer a request with `{"error": …}`, its body read and dropped first (`guard.drain`) so the answer is
    not lost to a TCP reset and the connection stays open. A 401 says `WWW-Authenticate: Bearer
    resource_metadata="…"` (RFC 9728; with `error="invalid_token"` when `refused` says the token was wrong),
    a 403 for a missing scope `error="insufficient_scope"` with the scope."""
    extra = []
    if status == 401 or (refused is not None and refused.missing_scope is not None):
        value = challenge(scope, invalid_token=refused is not None and refused.invalid_token,
                          insufficient_scope=refused.missing_scope if refused is not None else None)
        extra = [(b"www-authenticate", value.encode("latin-1"))]
    await send_error(send, status, error, receive=receive, headers=dict(scope.get("headers") or ()), extra=extra)
