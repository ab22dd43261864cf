"""`DeviceLink` and `close_socket`: the hub's end of one device's socket.

Several tasks write to a device at once (command batches, heartbeat replies, CANCELs, errors), a
socket may die under any of them, and a close must neither hang the server nor send a reason
longer than WebSocket allows. Those rules are the same for every frame, so they live here once:
a write answers True or False instead of raising, and a close is bounded. Which frames to send, and
when to give up on a device, stays with the hub.

Writes are not serialized here: an ASGI `send` carries one whole message, and uvicorn's WebSocket
protocols frame it and hand it to the transport in one synchronous step (the only wait, for a paused
transport, comes before it), so frames from several tasks never interleave. A lock per link had been
~4% of the server's CPU in a fan-out (py-spy), and an object per idle device.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from tether.protocol.codec import encode
from tether.protocol.messages import ServerMessage, ServerMessageType, TaskStatus
from tether.protocol.models import new_call_id
from tether.protocol.server_session import ServerSession
from tether.protocol.wire import SERVER_HEARTBEAT
from tether.server.aip.fleet.record import DeviceRecord
from tether.server.aip.sockets.socket import AIPSocket, SocketClosed

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


@dataclass(eq=False)
class DeviceLink:
    name: str
    socket: AIPSocket
    instance_id: str
    token_id: str
    record: DeviceRecord
    last_seen: float  # monotonic: liveness must not jump with the wall clock
    ready: bool = False  # REGISTER_ACK sent: commands may follow
    dropped: bool = False
    closer: asyncio.Task[None] | None = None  # the hub's close of this socket, awaited before serve returns
    session: ServerSession | None = None  # what its frames mean (protocol/server_session.py), set once registered

    async def send(self, message: ServerMessage) -> bool:
        return await self.send_text(encode(message))

    async def heartbeat(self) -> bool:
        """The answer to a device's heartbeat: the frame `encode(ServerMessage(type=HEARTBEAT, status=OK))`
        makes, written from a template (no model, no uuid4 per beat: 10,000 idle devices beat all day)."""
        return await self.send_text(SERVER_HEARTBEAT % (datetime.now(UTC).isoformat(), new_call_id()))

    async def send_text(self, text: str) -> bool:
        try:
            await self.socket.send_text(text)
            return True
        except SocketClosed:
            return False
        except Exception as exc:
            logger.warning("sending to device %s failed: %s", self.name, exc)
            return False

    async def error(self, error: str, reason: str) -> None:
        await self.send(ServerMessage(type=ServerMessageType.ERROR, status=TaskStatus.ERROR, error=error,
                                      payload={"reason": reason}))


async def close_socket(socket: AIPSocket, code: int, reason: str) -> None:
    short = reason.encode("utf-8")[:120].decode("utf-8", "ignore")  # close reasons are ≤ 123 bytes
    try:
        async with asyncio.timeout(5):
            await socket.close(code, short)
    except (SocketClosed, TimeoutError):
        pass
    except Exception as exc:
        logger.debug("closing a device socket failed: %s", exc)
