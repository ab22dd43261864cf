"""Registering: the profile a registration reports, the handshake (token, TLS pin, proxy) and the REGISTER /
ACK exchange of one connection attempt (`DeviceSession` says what the frames mean)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tether.device.link import settings as link_settings
from tether.device.link.batch_runner import BatchRunner
from tether.device.link.outbox import Outbox
from tether.device.link.reconnect import (
    PIN_MISMATCH,
    FailureLog,
    RegistrationRefused,
    ServerURLs,
    attempt_timeout,
    describe_failure,
)
from tether.device.link.settings import PROFILE_REUSE_S, TRANSPORT_MAX_BYTES, LinkSettings
from tether.device.link.trust.device_key import DeviceKey
from tether.device.link.trust.tls_pin import PinMismatch, pinned_context_for_async
from tether.protocol.codec import FrameError
from tether.protocol.device_session import BadFrame, DeviceSession, Refused
from tether.protocol.identity import CHALLENGE_HEADER
from tether.protocol.messages import RegisterAck
from tether.protocol.profile import DeviceProfile

# the link's records keep the one logger name operators filter on (`tether.device.link.connection`)
logger = logging.getLogger("tether.device.link.connection")


def _refusal_reason(body: bytes | bytearray | None) -> str | None:
    """The `error` of a refused handshake's `{"error": …}` body, if it has one (shortened, one line)."""
    try:
        error = json.loads(body or b"").get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, str) or not error:
        return None
    return " ".join(error.split())[:500]



class Registering:
    """`DeviceConnection`'s attempts: collect the profile, connect, register, then hand the link to `_serve`."""

    name: str | None
    instance_id: str
    key: DeviceKey
    settings: LinkSettings
    servers: ServerURLs
    outbox: Outbox
    batches: BatchRunner
    ack: RegisterAck | None
    registered_as: str | None
    connections: int
    _token: str | None
    _pin: str | None
    _ssl: ssl.SSLContext | None
    _proxies: dict[str, str | None]
    _profile: Callable[[], Awaitable[DeviceProfile]] | None
    _spare_profile: tuple[float, int, DeviceProfile] | None
    _profile_version: int
    _registered_version: int
    _failures: FailureLog

    if TYPE_CHECKING:
        @property
        def url(self) -> str: ...

        def _grace_left(self) -> float | None: ...

        async def _serve(self, ws: ClientConnection, session: DeviceSession, ack: RegisterAck) -> float: ...

    async def _collect_profile(self) -> DeviceProfile:
        return await self._try_profile() or DeviceProfile()

    async def _try_profile(self) -> DeviceProfile | None:
        if self._profile is None:
            return DeviceProfile()
        try:
            return await self._profile()
        except Exception:  # a broken self-check must not keep the device offline
            logger.exception("collecting the device profile failed; registering with an empty one")
            return None

    async def _profile_for_attempt(self) -> DeviceProfile:
        """The profile to register with: the one the previous attempt collected if that attempt never
        registered, is younger than PROFILE_REUSE_S and the tools have not changed since; else a new one."""
        now = asyncio.get_running_loop().time()
        spare = self._spare_profile
        if spare is not None and spare[1] == self._profile_version and now - spare[0] < PROFILE_REUSE_S:
            return spare[2]
        version = self._profile_version
        profile = await self._try_profile()
        if profile is None:
            return DeviceProfile()
        self._spare_profile = (now, version, profile)
        return profile

    async def _session(self) -> float | None:
        """One connection: None if it never registered (errors raise), else how long it was up."""
        self._registered_version = self._profile_version
        profile = await self._profile_for_attempt()
        # the token travels in the handshake's Authorization header (never the URL): the server checks
        # it before upgrading the connection and answers 401 {"error": …} without reading a frame
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        timeout = attempt_timeout(self.settings.connect_timeout, self._grace_left())
        if self._pin:  # each attempt: the certificate is checked before the token goes anywhere
            try:
                self._ssl = await pinned_context_for_async(self.url, self._pin, timeout)
            except PinMismatch as exc:
                raise RegistrationRefused(str(exc), PIN_MISMATCH) from None
        try:
            ws = await connect(self.url, additional_headers=headers, ssl=self._ssl, open_timeout=timeout,
                               proxy=self._proxies[self.url],
                               max_size=TRANSPORT_MAX_BYTES, ping_interval=link_settings.KEEPALIVE_S,
                               ping_timeout=link_settings.KEEPALIVE_S,
                               close_timeout=2.0, compression=None, user_agent_header="tether-device")
        except InvalidStatus as exc:
            if exc.response.status_code in (401, 403):
                reason = _refusal_reason(exc.response.body)
                failure = describe_failure(exc)
                raise RegistrationRefused(f"{failure}: {reason}" if reason else failure,
                                          exc.response.status_code) from None
            raise
        try:
            challenge = ws.response.headers.get(CHALLENGE_HEADER) if ws.response is not None else None
            session, ack = await self._register(ws, profile, timeout, challenge)
            return await self._serve(ws, session, ack)
        finally:
            with contextlib.suppress(Exception):
                await ws.close()

    async def _register(self, ws: ClientConnection, profile: DeviceProfile, timeout: float,
                        challenge: str | None = None) -> tuple[DeviceSession, RegisterAck]:
        """Register on `ws` (the frames are `DeviceSession`'s): the session, open, and the server's ACK."""
        session = DeviceSession(self.name, self.instance_id)
        # with the proof of the device's key, for the challenge the server gave this connection (a server that
        # gives none, an older one, is sent none: its registration model knows no proof)
        await ws.send(session.register(profile, self.outbox.pending_call_ids(), challenge, self.key))
        try:
            async with asyncio.timeout(timeout):
                raw = await ws.recv()
        except TimeoutError:
            raise TimeoutError(f"no answer to the registration within {timeout:g}s") from None
        except ConnectionClosed as exc:
            rcvd = exc.rcvd
            refused = session.closed(rcvd.code, rcvd.reason) if rcvd is not None else None
            if refused is not None:
                raise RegistrationRefused(refused.reason, refused.code) from None
            raise
        verdict = session.registration_reply(raw)
        if isinstance(verdict, Refused):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.connect_timeout):
                    await ws.wait_closed()
            refused = session.closed(ws.close_code, ws.close_reason or "")
            raise RegistrationRefused(refused.reason if refused is not None else verdict.reason, ws.close_code)
        if isinstance(verdict, BadFrame):
            if verdict.frame_error:
                raise FrameError(verdict.reason, verdict.error)
            raise ConnectionError(verdict.error)
        ack = verdict.ack
        self.ack = ack
        self.registered_as = ack.device
        self.connections += 1
        self.servers.registered()
        self._spare_profile = None  # the next registration, after this link, gets a fresh one
        self._failures.succeeded(self.url)
        logger.info("registered as %s (connection %d%s)", ack.device, self.connections,
                    ", resumed" if ack.resumed else "")
        if not ack.resumed and self.batches.running:
            stopped = self.batches.orphan_all("the server no longer waits for this batch (it restarted, or gave "
                                              "this device up after its grace period)")
            logger.warning("stopped %d batch(es) from before the reconnection: no server waits for them", stopped)
        return session, ack
