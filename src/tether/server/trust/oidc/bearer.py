"""`Bearers`: the bearer check of every API request, `/mcp` and the request guard's body cap.

A secret shaped as a JWT goes to the OIDC verifier when issuers are configured (`oidc:`); anything else is one
of tether's own tokens (`Tokens.check`). Without issuers this is `Tokens.check` and nothing else: PyJWT is
imported only when a JWT is first checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tether.server.store.tokens import TokenInfo
from tether.server.trust.oidc.config import OidcIssuer
from tether.server.trust.oidc.verify import OidcRefused, OidcVerifier

__all__ = ["Bearers", "OidcRefused", "TokenTable", "is_jwt", "request_origin"]


class TokenTable(Protocol):
    """What `Bearers` needs of the tokens table (`tether.server.store.tokens.Tokens`)."""

    async def check(self, secret: str) -> TokenInfo | None: ...


def request_origin(scope: Mapping[str, Any]) -> str:
    """`scheme://host[:port]` of an HTTP request as its client addressed it (the Host header, which the request
    guard has checked against the server's names; else the server's address)."""
    headers = dict(scope.get("headers") or ())
    host = headers.get(b"host", b"").decode("latin-1").strip()
    if not host:
        server = scope.get("server") or ("127.0.0.1", None)
        host = f"{server[0]}:{server[1]}" if server[1] else str(server[0])
    return f"{scope.get('scheme', 'http')}://{host}"


class Bearers:
    """tether's API tokens, then the configured OIDC issuers' tokens (`app.state.bearer`)."""

    def __init__(self, tokens: TokenTable, issuers: Sequence[OidcIssuer] = ()) -> None:
        self.tokens = tokens
        self.issuers = list(issuers)
        self._verifier: OidcVerifier | None = None  # built at the first JWT

    @property
    def authorization_servers(self) -> list[str]:
        """The issuers `/mcp`'s Protected Resource Metadata names (those with `advertise`)."""
        return [issuer.issuer for issuer in self.issuers if issuer.advertise]

    def verifier(self) -> OidcVerifier:
        """The OIDC verifier (built on first use)."""
        if self._verifier is None:
            self._verifier = OidcVerifier(self.issuers)
        return self._verifier

    async def check(self, secret: str, scope: Mapping[str, Any] | None = None) -> TokenInfo | None:
        """The token a bearer secret is, or None for none of tether's (unknown, revoked). A JWT of a configured
        issuer is verified against the request's origin (`scope`, for the default audience); one that does not
        verify or grants nothing raises `OidcRefused` (its status and why)."""
        if self.issuers and is_jwt(secret):
            return await self.verifier().verify(secret, request_origin(scope) if scope is not None else None)
        return await self.tokens.check(secret)

    async def body_ok(self, secret: str) -> bool:
        """Whether a bearer secret is a valid API token (for the request guard's body cap): tether's, or a JWT
        of a configured issuer that verifies and grants something (its audience is checked by the route)."""
        if self.issuers and is_jwt(secret):
            try:
                await self.verifier().verify(secret, None, check_audience=False)
            except OidcRefused:
                return False
            return True
        info = await self.tokens.check(secret)
        return info is not None and info.kind == "api"


def is_jwt(secret: str) -> bool:
    """Whether a bearer secret has a JWT's shape (a JSON header, three dot-separated parts): tether's own tokens
    (`tapi_…`, `tdev_…`) never do."""
    return secret.startswith("eyJ") and secret.count(".") == 2
