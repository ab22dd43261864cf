"""The throttles as the guard applies them: which one refuses a request, 401s counted, the 429 answer."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from tether.server.http.ratelimit import Throttled, Throttles
from tether.server.http.request_guard.answers import deny_websocket, send_error
from tether.server.http.request_guard.requests import Message, Scope, client_address, presents_credentials

logger = logging.getLogger(__package__)

_CLAIM = re.compile(r"/api/v1/pairing/([^/]{1,64})/claim/?$")


def throttled_by(throttles: Throttles, scope: Scope, headers: dict[bytes, bytes]) -> Throttled | None:
    """The throttle that refuses this request now, if any (a pairing claim spends one here)."""
    address = client_address(scope)
    if scope["type"] == "http" and scope.get("method") == "POST" and "/pairing/" in scope["path"]:
        claim = _CLAIM.search(scope["path"])
        if claim is not None and (refused := throttles.claim(address, claim.group(1))) is not None:
            return refused
    if presents_credentials(scope, headers):
        return throttles.credentials_blocked(address)
    return None


def counting_failures(send: Callable[[Message], Any], throttles: Throttles, address: str) -> Callable[[Message], Any]:
    """`send`, counting a 401 answer as a failed credential check of `address`. A plain function that
    returns `send`'s awaitable: no coroutine frame per message."""

    def counted(message: Message) -> Any:
        if message["type"] == "http.response.start" and message["status"] == 401:
            throttles.credentials_failed(address)
        return send(message)

    return counted


async def answer_throttled(scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any],
                           headers: dict[bytes, bytes], throttled: Throttled) -> None:
    """The 429 `{"error": …}` with `Retry-After` (a WebSocket handshake: as its denial response)."""
    logger.warning("throttled %s %s from %s: %s", "WebSocket" if scope["type"] == "websocket" else scope.get("method"),
                   scope.get("path"), client_address(scope), throttled.error)
    extra = [(b"retry-after", throttled.retry_after.encode())]
    if scope["type"] == "websocket":
        await deny_websocket(scope, send, 429, throttled.error, extra)
    else:
        await send_error(send, 429, throttled.error, receive=receive, headers=headers, extra=extra)


async def throttled_handshake(scope: Scope, send: Callable[[Message], Any], headers: dict[bytes, bytes]) -> bool:
    """For the AIP socket, which front.py runs without the guard around it: True when a throttle refused
    the handshake (answered 429)."""
    throttles: Throttles | None = getattr(scope.get("app"), "throttles", None)
    if throttles is None:
        return False
    throttled = throttled_by(throttles, scope, headers)
    if throttled is None:
        return False
    await answer_throttled(scope, _no_body, send, headers, throttled)
    return True


async def _no_body() -> Message:
    return {"type": "websocket.disconnect", "code": 1000}
