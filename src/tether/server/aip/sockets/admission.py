"""`DeviceHub`'s part that admits a device connection: authentication, the REGISTER frame, the key's proof,
a duplicate or returning process, and the REGISTER_ACK."""

from __future__ import annotations

import asyncio
import logging
import time

from tether.protocol.messages import (
    RegisterAck,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.server_session import (
    RegistrationRefused,
    ServerSession,
)
from tether.protocol.wire import CloseCode
from tether.server.aip.hub_state import HubState
from tether.server.aip.sockets.link import DeviceLink, close_socket
from tether.server.aip.sockets.registration import authenticate, prove_key, refusal_of, refuse
from tether.server.aip.sockets.socket import AIPSocket, Refusal, SocketClosed
from tether.server.store.tokens import TokenInfo

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class HubAdmission(HubState):
    """One connection from its registration to its cleanup."""

    async def serve(self, socket: AIPSocket, authorization: str | None, peer: str | None = None,
                    challenge: str | None = None) -> None:
        """Run one device connection from registration to cleanup. Never raises for what a device does.
        `challenge` is the one this connection was given (`protocol.identity`): the registration must
        prove the device's key with it (`registration.prove_key`)."""
        conn: DeviceLink | None = None
        if self._closed:
            await close_socket(socket, CloseCode.GOING_AWAY, "server shutting down")
            return
        try:
            conn = await self._register(socket, authorization, peer, challenge)
            if conn is not None:
                await self._receive_loop(conn)
        except Exception:
            logger.exception("device connection from %s failed", peer)
        finally:
            if conn is not None:
                self._drop(conn, "disconnected")
                if conn.closer is not None:  # let the close code reach the device before the socket goes
                    await asyncio.wait([conn.closer])

    async def _register(self, socket: AIPSocket, authorization: str | None, peer: str | None,
                        challenge: str | None = None) -> DeviceLink | None:
        """Register a connection. A device whose grace period ends while its (authenticated) registration
        is under way is not given up: it came back in time, the end of its grace waits for the outcome."""
        arriving = await self.authenticate(authorization)
        if isinstance(arriving, Refusal):
            await refuse(socket, arriving, peer)
            return None
        name = arriving.name
        self._arriving[name] = self._arriving.get(name, 0) + 1
        try:
            return await self._register_device(socket, authorization, peer, challenge)
        finally:
            self._arriving[name] -= 1
            if not self._arriving[name]:
                del self._arriving[name]
                if name in self._expired_meanwhile:
                    self._expired_meanwhile.discard(name)
                    self._grace_expired(name)

    async def _register_device(self, socket: AIPSocket, authorization: str | None,
                               peer: str | None, challenge: str | None = None) -> DeviceLink | None:
        settings = self.settings
        try:
            async with asyncio.timeout(settings.register_timeout):
                frame = await socket.receive_text()
        except TimeoutError:
            await refuse(socket, Refusal(CloseCode.BAD_REGISTRATION,
                                         f"no register frame within {settings.register_timeout:g}s"), peer)
            return None
        except SocketClosed:
            return None
        token = await self.authenticate(authorization)  # again: it may have been revoked meanwhile
        if isinstance(token, Refusal):
            await refuse(socket, token, peer)
            return None
        name = token.name
        session = ServerSession(name, settings.max_frame_bytes)  # what this connection's frames mean
        reg = session.register(frame)
        if isinstance(reg, RegistrationRefused):
            await refuse(socket, refusal_of(reg), peer)
            return None
        # a device is its key, not its token; the key's statements off the event loop (PostgreSQL)
        unproven = await self.store.call(prove_key, self.store, name, reg, challenge)
        if unproven is not None:
            await refuse(socket, unproven, peer)
            return None
        now = time.monotonic()
        old = self._conns.get(name)
        if old is not None and old.instance_id != reg.instance_id \
                and now - old.last_seen < settings.heartbeat_timeout:
            await refuse(socket, Refusal(CloseCode.DUPLICATE, (
                f"device '{name}' is already connected from {old.record.address or 'elsewhere'} (another process, "
                f"heard from {now - old.last_seen:.1f}s ago); stop it or wait {settings.heartbeat_timeout:g}s")), peer)
            return None
        record = self.registry.ensure(name)
        resumed = record.instance_id == reg.instance_id
        previous = record.instance_id or self._given_up.pop(name, None)
        if previous is not None and previous != reg.instance_id:
            self._restarted(name)
        if old is not None:  # same process reconnecting, or a stale one: the new connection wins
            self._drop(old, "replaced", grace=False)
            self._close_conn(old, CloseCode.REPLACED, "replaced by a new connection")
        if record.instance_id is not None and not resumed:
            self._batches.forget_cancels(name)
            self._batches.fail_device(name, f"device {name} restarted; outcome unknown", sent_only=True)
        self._grace.stop(name)
        self._batches.registered(name)
        conn = DeviceLink(name, socket, reg.instance_id, token.id, record, now, session=session)
        self._conns[name] = conn
        record.node = None  # held here now, whichever node held it before
        record.connected, record.profile, record.instance_id, record.address = True, reg.profile, reg.instance_id, peer
        record.connected_at = record.last_seen = time.time()
        record.running = record.queued = 0
        self._remember(name, record, record.last_seen)
        self.registry.notify()
        self._fleet_changed(name)
        if self.remote is not None:  # registered means reachable from every node: in the directory first
            await self.remote.claimed(name)
        ack = RegisterAck(device=name, heartbeat_interval=settings.heartbeat_interval,
                          heartbeat_timeout=settings.heartbeat_timeout, grace_period=settings.grace_period,
                          max_frame_bytes=settings.max_frame_bytes, resumed=resumed)
        await conn.send(ServerMessage(type=ServerMessageType.REGISTER_ACK, status=TaskStatus.OK,
                                      payload=ack.model_dump()))
        session.open()
        conn.ready = True
        logger.info("device %s registered from %s (instance %s%s)", name, peer, reg.instance_id,
                    ", resumed" if resumed else "")
        await self._router.flush(conn, resend=resumed)
        return conn

    async def authenticate(self, authorization: str | None) -> TokenInfo | Refusal:
        """The device token's info, or the refusal saying why the connection is unauthorized
        (`registration.authenticate`; the AIP endpoint applies it before the upgrade too)."""
        return await authenticate(self.store, authorization)
