"""The AIP endpoint's transport: close codes, the socket the hub talks to, and the Starlette adapter."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from tether.server.guard import deny_websocket

if TYPE_CHECKING:
    from tether.server.hub import DeviceHub

logger = logging.getLogger(__name__)

CLOSE_GOING_AWAY = 1001  # the server shuts down
CLOSE_REPLACED = 4000  # a newer connection of the same device took over
CLOSE_HEARTBEAT_TIMEOUT = 4001  # the device fell silent; it may reconnect
CLOSE_BAD_REGISTRATION = 4400  # first frame not a valid REGISTER, wrong protocol version, no frame in time
CLOSE_UNAUTHORIZED = 4401  # missing, unknown or revoked token, or not a device token
CLOSE_WRONG_DEVICE = 4403  # the registration claims another device than the token's
CLOSE_DUPLICATE = 4409  # another live process of this device is connected


class SocketClosed(Exception):
    def __init__(self, code: int = 1006, reason: str = "") -> None:
        super().__init__(f"socket closed ({code}{': ' + reason if reason else ''})")
        self.code = code
        self.reason = reason


class AIPSocket(Protocol):
    """The three things the hub needs from a WebSocket; `receive_text` raises `SocketClosed`."""

    async def send_text(self, data: str) -> None: ...
    async def receive_text(self) -> str: ...
    async def close(self, code: int = 1000, reason: str = "") -> None: ...


class StarletteSocket:
    """`AIPSocket` over a Starlette WebSocket; every way the socket can be gone becomes `SocketClosed`."""

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.closed = False

    async def send_text(self, data: str) -> None:
        try:
            await self.websocket.send_text(data)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise SocketClosed(getattr(exc, "code", 1006)) from None

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
        if self.closed:  # the first close wins: its code is the one the device must see
            return
        self.closed = True
        try:
            await self.websocket.close(code, reason)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass


def aip_route(hub: DeviceHub, path: str = "/aip") -> WebSocketRoute:
    """The AIP endpoint: authenticate the handshake, accept, then let the hub run the connection.

    The device token is checked on the handshake's `Authorization` header, before the upgrade: a
    connection without a valid device token gets `401 {"error": …}` and the server never reads a
    frame from it (so unauthenticated peers cannot make it buffer registration frames). The hub
    checks the token again with the REGISTER frame: it may have been revoked in between.
    """

    async def endpoint(websocket: WebSocket) -> None:
        client = websocket.client
        peer = f"{client.host}:{client.port}" if client else None
        authorization = websocket.headers.get("authorization")
        verdict = hub._authenticate(authorization)  # the hub's rule, applied before any frame is read
        if isinstance(verdict, str):
            logger.warning("refused device connection from %s at the handshake: %s", peer, verdict)
            await deny_websocket(websocket.scope, websocket.send, 401, verdict)
            return
        await websocket.accept()
        socket = StarletteSocket(websocket)
        try:
            await hub.serve(socket, authorization, peer)
        finally:
            await socket.close(1000)

    return WebSocketRoute(path, endpoint, name="aip")
