"""`/mcp` as an OAuth protected resource (RFC 9728, as the MCP authorization specification requires).

`GET /.well-known/oauth-protected-resource/mcp` (the path-suffixed form clients try first) and
`GET /.well-known/oauth-protected-resource` answer the Protected Resource Metadata of `/mcp`, and every 401
from `/mcp` points at it: `WWW-Authenticate: Bearer resource_metadata="…"`, with `error="invalid_token"`
when a token was sent and is not valid. Its `resource` is the `/mcp` URL as the client reached it (scheme
and Host of the request, which the app's RequestGuard has checked), because a client must discard metadata
whose `resource` differs from the URL it used. tether's own API tokens need no authorization server, so
`authorization_servers` is there only when configured (`mcp_authorization_servers`, and the OIDC issuers of
`oidc:` whose tokens the server accepts).

Written without the `mcp` SDK: it is served by the app without loading the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from tether.server.store.tokens import SCOPES
from tether.server.trust.oidc.bearer import request_origin

WELL_KNOWN = "/.well-known/oauth-protected-resource"
MCP_PATH = "/mcp"
RESOURCE_NAME = "tether fleet (MCP gateway)"


def metadata_url(scope: Mapping[str, Any]) -> str:
    """Where the metadata of `/mcp` is, for a request's 401: the path-suffixed well-known URL (RFC 9728 §3.1)."""
    return f"{request_origin(scope)}{WELL_KNOWN}{MCP_PATH}"


def challenge(scope: Mapping[str, Any], *, invalid_token: bool = False, insufficient_scope: str | None = None) -> str:
    """The `WWW-Authenticate` value of a refusal from `/mcp` (RFC 6750 §3, RFC 9728 §5.1)."""
    parts = []
    if invalid_token:
        parts.append('error="invalid_token"')
    elif insufficient_scope is not None:
        parts += ['error="insufficient_scope"', f'scope="{insufficient_scope}"']
    parts.append(f'resource_metadata="{metadata_url(scope)}"')
    return "Bearer " + ", ".join(parts)


def protected_resource_metadata(scope: Mapping[str, Any], authorization_servers: list[str]) -> dict[str, Any]:
    """The Protected Resource Metadata document of `/mcp` (RFC 9728 §2) for a request that asked for it."""
    document: dict[str, Any] = {"resource": f"{request_origin(scope)}{MCP_PATH}",
                                "bearer_methods_supported": ["header"], "scopes_supported": list(SCOPES),
                                "resource_name": RESOURCE_NAME}
    if authorization_servers:
        document["authorization_servers"] = list(authorization_servers)
    return document


async def metadata_endpoint(request: Request) -> JSONResponse:
    """The route behind both well-known URLs: the document, public, cacheable for an hour."""
    settings = request.app.state.settings
    servers = list(getattr(settings, "mcp_authorization_servers", None) or [])
    bearer = getattr(request.app.state, "bearer", None)  # the OIDC issuers accepted (server/trust/oidc)
    servers += [s for s in (bearer.authorization_servers if bearer is not None else []) if s not in servers]
    return JSONResponse(protected_resource_metadata(request.scope, servers),
                        headers={"Cache-Control": "public, max-age=3600"})
