"""The ASGI shapes the guard works on, and what it reads off a request: the client's address, its credentials."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[..., Any]

LOGIN_SUFFIX = "/web/login"


def client_address(scope: Scope) -> str:
    """The client's address as the ASGI server reports it ('' when it reports none)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def presents_credentials(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    """Whether the request carries something a failed check of which counts: an `Authorization` header or
    a dashboard login. (Not a cookie: a dashboard session id is not guessable, and a browser holding a
    stale one would throttle its own next login.)"""
    return b"authorization" in headers or (scope.get("method") == "POST" and scope["path"].endswith(LOGIN_SUFFIX))
