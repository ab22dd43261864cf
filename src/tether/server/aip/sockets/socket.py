"""The AIP endpoint's transport: the socket the hub talks to, and the Starlette adapter."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from tether.errors import ServerError
from tether.protocol.identity import CHALLENGE_HEADER, new_challenge
from tether.server.http.internals import websocket_send_raw
from tether.server.http.request_guard import deny_websocket
from tether.server.store.tokens import TokenInfo

if TYPE_CHECKING:
    from tether.server.settings import ServerSettings

logger = logging.getLogger("tether.server.aip.socket")  # the name operators filter on


class SocketClosed(ServerError):
    def __init__(self, code: int = 1006, reason: str = "") -> None:
        super().__init__(f"socket closed ({code}{': ' + reason if reason else ''})")
        self.code = code
        self.reason = reason


class AIPSocket(Protocol):
    """The three things the hub needs from a WebSocket; `receive_text` raises `SocketClosed`."""

    async def send_text(self, data: str) -> None: ...
    async def receive_text(self) -> str: ...
    async def close(self, code: int = 1000, reason: str = "") -> None: ...


@dataclass(frozen=True)
class Refusal:
    """Why a device's connection is refused: the WebSocket close code (a `CloseCode`) and the reason it is shown."""

    code: int
    error: str


class AIPEndpoint(Protocol):
    """What the endpoint (`aip_route`) needs of the hub: its token rule, its connection loop, its settings."""

    @property
    def settings(self) -> ServerSettings:
        """The server's settings (`max_admitting` bounds the registrations under way)."""

    async def authenticate(self, authorization: str | None) -> TokenInfo | Refusal:
        """The device token's info for an `Authorization` header, or why the connection is refused."""

    async def serve(self, socket: AIPSocket, authorization: str | None, peer: str | None = None,
                    challenge: str | None = None) -> None:
        """Run one accepted device connection from registration to cleanup; never raises for the device."""


_CHALLENGE_HEADER = CHALLENGE_HEADER.lower().encode("ascii")
ADMISSION_STATUS = 503  # the handshake's HTTP answer when too many sockets are registering: retry after Retry-After
ADMISSION_RETRY_MAX_S = 10


class Admission:
    """Admission control for reconnect storms: at most `limit` sockets between their handshake and their
    registration (the register-ack, or their close). One over the limit is refused before the upgrade
    with HTTP 503, `Retry-After` and `{"error": …}` — cheap for the server, and retried by the device
    after that long plus its own jittered backoff — so the registrations under way finish well inside
    their deadline, and /health and the registered devices' commands keep the event loop to themselves
    for the rest. `Retry-After` grows with the refusals of the current second (how many are waiting)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.admitting = 0
        self.refused = 0  # in all, for the log and the benchmarks
        self._second = 0
        self._refused_this_second = 0

    def enter(self) -> bool:
        if self.admitting >= self.limit:
            self.refused += 1
            now = int(time.monotonic())
            if now != self._second:
                self._second, self._refused_this_second = now, 0
            self._refused_this_second += 1
            return False
        self.admitting += 1
        return True

    def leave(self) -> None:
        self.admitting -= 1

    def retry_after(self) -> int:
        """Seconds a refused device should wait: 1, more the more were refused this second."""
        return max(1, min(ADMISSION_RETRY_MAX_S, math.ceil(self._refused_this_second / (4 * self.limit))))


class StarletteSocket:
    """`AIPSocket` over a Starlette WebSocket; every way the socket can be gone becomes `SocketClosed`.

    `on_settled`, when given, is called once: at the first frame sent (the register-ack, or the error
    before a refusal) or at the close, whichever comes first — the end of its admission."""

    def __init__(self, websocket: WebSocket, on_settled: Callable[[], None] | None = None) -> None:
        self.websocket = websocket
        self.closed = False
        self._on_settled = on_settled

    def _settled(self) -> None:
        if self._on_settled is not None:
            settled, self._on_settled = self._on_settled, None
            settled()

    async def send_text(self, data: str) -> None:
        """Straight to the ASGI server's `send` once the socket is accepted: Starlette's `send_text` and
        `send` are two more coroutines and a state check per frame, ~8% of the server's CPU in a fan-out
        to 10,000 devices (py-spy). Its state still rules: what it refuses, or the server's own refusal
        of a socket that is gone, is `SocketClosed` as before."""
        if self._on_settled is not None:
            self._settled()
        websocket = self.websocket
        if self.closed or websocket.application_state is not WebSocketState.CONNECTED:
            raise SocketClosed()
        try:
            await websocket_send_raw(websocket, {"type": "websocket.send", "text": data})
        except (RuntimeError, OSError):  # uvicorn: ClientDisconnected (an OSError), or a frame after the close
            websocket.application_state = WebSocketState.DISCONNECTED
            raise SocketClosed() from None

    async def receive_text(self) -> str:
        try:
            message = await self.websocket.receive()
        except (RuntimeError, OSError):
            raise SocketClosed() from None
        if message["type"] == "websocket.disconnect":
            raise SocketClosed(message.get("code", 1005), message.get("reason") or "")
        text = message.get("text")
        if text is None:  # a binary frame: let the codec judge it like any other
            return (message.get("bytes") or b"").decode("utf-8", "replace")
        return text

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self._settled()
        if self.closed:  # the first close wins: its code is the one the device must see
            return
        self.closed = True
        try:
            await self.websocket.close(code, reason)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass


def aip_route(hub: AIPEndpoint, path: str = "/aip", admission: Admission | None = None) -> WebSocketRoute:
    """The AIP endpoint: authenticate the handshake, accept, then let the hub run the connection.

    The device token is checked on the handshake's `Authorization` header, before the upgrade: a
    connection without a valid device token gets `401 {"error": …}` and the server never reads a
    frame from it (so unauthenticated peers cannot make it buffer registration frames). The hub
    checks the token again with the REGISTER frame: it may have been revoked in between. Then
    `admission` (by default `Admission(settings.max_admitting)`) bounds the registrations under way.
    The upgrade's answer carries a fresh challenge (`X-Tether-Challenge`), which the REGISTER must sign
    with the device's key (`registration.prove_key`): a token alone registers nothing.
    """
    gate = admission or Admission(getattr(hub.settings, "max_admitting", 256))

    async def busy(websocket: WebSocket) -> None:
        wait = gate.retry_after()
        await deny_websocket(websocket.scope, websocket.send, ADMISSION_STATUS,
                             f"server busy: {gate.admitting} devices are registering; retry after {wait} s",
                             headers=[(b"retry-after", str(wait).encode())])

    async def endpoint(websocket: WebSocket) -> None:
        client = websocket.client
        peer = f"{client.host}:{client.port}" if client else None
        authorization = websocket.headers.get("authorization")
        if gate.admitting >= gate.limit:  # full: refused before even the token is looked at (cheapest)
            gate.enter()  # counts the refusal
            await busy(websocket)
            return
        verdict = await hub.authenticate(authorization)  # the hub's rule, applied before any frame is read
        if not isinstance(verdict, TokenInfo):
            logger.warning("refused device connection from %s at the handshake: %s", peer, verdict.error)
            await deny_websocket(websocket.scope, websocket.send, 401, verdict.error)
            return
        del verdict  # the hub checks the token again; this frame lives as long as the socket
        if not gate.enter():  # filled up while the token was checked (it does not await: not today)
            await busy(websocket)
            return
        challenge = new_challenge()  # the registration signs it with the device's key (protocol.identity)
        try:
            await websocket.accept(headers=[(_CHALLENGE_HEADER, challenge.encode("ascii"))])
        except BaseException:
            gate.leave()
            raise
        socket = StarletteSocket(websocket, on_settled=gate.leave)
        try:
            await hub.serve(socket, authorization, peer, challenge)
        finally:
            await socket.close(1000)

    return WebSocketRoute(path, endpoint, name="aip")
