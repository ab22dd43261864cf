"""The guard's answers: a whole `{"error": …}` response, a refused WebSocket handshake, and a small body
read and dropped first so that the answer is not lost to a reset."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable
from typing import Any

from tether.server.http.logsafe import mark_denied_handshake
from tether.server.http.ratelimit import Throttles
from tether.server.http.request_guard.requests import Message, Scope, client_address, presents_credentials
from tether.server.settings import ANONYMOUS_BODY_BYTES


async def send_error(send: Callable[[Message], Any], status: int, error: str, *,
                     receive: Callable[[], Any] | None = None, headers: dict[bytes, bytes] | None = None,
                     extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A complete `{"error": …}` response.

    Given the request's `receive` and `headers`, a small body (see `drain`) is read and dropped first and
    the connection stays open. Otherwise the connection is closed after the answer: the body was not
    read, so the connection cannot carry another request — and the client may lose the answer to the
    TCP reset that closing a socket with unread bytes sends, a cost only a body too large to read pays.
    """
    kept = receive is not None and headers is not None and await drain(receive, headers)
    body = json.dumps({"error": error}).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    if not kept:
        start.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


DRAIN_TIMEOUT = 5.0


async def drain(receive: Callable[[], Any], headers: dict[bytes, bytes]) -> bool:
    """Read and drop a request body of at most `ANONYMOUS_BODY_BYTES` declared in Content-Length (or no
    body at all); True when it ended within `DRAIN_TIMEOUT`. A larger or chunked body is not read
    (False): a refused request does not get to make the server read megabytes."""
    declared = headers.get(b"content-length")
    if declared is None:
        if b"transfer-encoding" in headers:
            return False
    else:
        text = declared.decode("latin-1").strip()
        if not text.isdigit() or int(text) > ANONYMOUS_BODY_BYTES:
            return False
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT):
            return await receive_body(receive) is not None
    except TimeoutError:
        return False


async def receive_body(receive: Callable[[], Any]) -> bytes | None:
    """The whole request body off ASGI `receive`, or None when the client left first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def deny_websocket(scope: Scope, send: Callable[[Message], Any], status: int, error: str,
                         headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Refuse a WebSocket handshake: an HTTP answer with `{"error": …}` (and `headers`, e.g. Retry-After)
    where the server supports denial responses, else the plain 403 a close before accept becomes.
    A 401 to a handshake that carried credentials counts as a failed check (`Throttles`)."""
    mark_denied_handshake()
    if status == 401:
        throttles: Throttles | None = getattr(scope.get("app"), "throttles", None)
        if throttles is not None and presents_credentials(scope, dict(scope.get("headers") or ())):
            throttles.credentials_failed(client_address(scope))
    if "websocket.http.response" in (scope.get("extensions") or {}):
        body = json.dumps({"error": error}).encode()
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *(headers or [])]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": ""})
