"""`DeviceConnection`: a device's persistent AIP link to the agent server (seed 002).

It connects to `ws(s)://host:port/aip` with the device token in the `Authorization` header, registers
(profile, a random per-process `instance_id`, the call_ids waiting in the outbox), then serves:
a reader that never waits for a tool (so heartbeats and cancellations are answered while a batch
runs), a sender that drains the outbox, and a heartbeat that also notices a server gone silent.
Batches run in a `BatchRunner` that outlives connections: a dropped link never cancels work, and
results finished meanwhile are delivered first after the next registration. What each frame says, and
the REGISTER frame itself, are `tether.protocol.device_session.DeviceSession`'s (sans-I/O); this module
does the socket, the timing and what each event asks for.

When the link drops it reconnects forever by default, with exponential backoff and full jitter
under a cap (so a fleet of devices does not reconnect in lockstep after a server restart). A
refusal that retrying cannot fix — bad token, name mismatch, unsupported version — stops `run()`
with `RegistrationRefused` carrying the server's words; "that device is already connected"
(4409) is retried, since the other connection may be this device's own dead one. That policy is
in `tether.device.link.reconnect`. While the device owes the server something (results in the outbox,
batches queued or running), the waits are also held well inside the grace period the server's
last RegisterAck promised (counted from the moment the link was lost), so a server that is
reachable again gets the results before it gives the batches up. A long outage is logged once
per kind of failure, then once a minute, then its end (`reconnect.FailureLog`).

An idle link costs one heartbeat frame each way per interval and nothing else: the heartbeat is
written from a template, the server's reply recognised by its shape (`codec.HeartbeatFrame`,
`codec.is_server_heartbeat`), and the socket's own keepalive pings are stopped when the heartbeat
would notice a silent server first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, InvalidStatus, InvalidURI
from websockets.protocol import State
from websockets.proxy import get_proxy
from websockets.uri import parse_uri

from tether.device.client import DeviceClient
from tether.device.link.batch_runner import DEFAULT_MAX_CONCURRENT_SESSIONS, BatchRunner, run_in_this_task
from tether.device.link.device_key import DeviceKey
from tether.device.link.keepalive import beat_due
from tether.device.link.outbox import DEFAULT_RECORD_BYTES, FinishedRecord, Outbox
from tether.device.link.reconnect import (
    PIN_MISMATCH,
    RESTART_SPREAD_S,
    RETRYABLE,
    FailureLog,
    RegistrationRefused,
    RetriesExhausted,
    ServerURLs,
    attempt_timeout,
    backoff_delay,
    describe_failure,
    retry_after_of,
)
from tether.device.link.tls_pin import PinMismatch, normalize_fingerprint, pinned_context_for_async
from tether.device.mcp.client.elicit import RemoteQuestions, RemoteSampler
from tether.device.policy_overlay import RemotePolicy
from tether.errors import DeviceError
from tether.protocol.codec import FrameError, HeartbeatFrame, encode
from tether.protocol.device_session import (
    BadFrame,
    CancelArrived,
    CommandsArrived,
    DeviceSession,
    ElicitationAnswer,
    HeartbeatAck,
    OutcomeQuery,
    PolicyRequest,
    ProfileRequested,
    Refused,
    SamplingReply,
    ServerReportedError,
    SessionEvent,
    Unexpected,
)
from tether.protocol.identity import CHALLENGE_HEADER
from tether.protocol.messages import (
    ClientMessage,
    ClientMessageType,
    RegisterAck,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.profile import DeviceProfile

logger = logging.getLogger(__name__)

ConnectionState = Literal["idle", "connecting", "registered", "disconnected", "refused", "stopped"]
StateHook = Callable[[ConnectionState, "DeviceConnection"], None]

# The socket's own hard limit, only a guard against absurd frames: the protocol's limit (from the
# ACK) is checked on each frame so that an oversized frame gets an ERROR reply, not a closed link.
TRANSPORT_MAX_BYTES = 64 * 1024 * 1024
KEEPALIVE_S = 20.0
# A profile collected for an attempt that never registered serves the next attempts for this long: a
# device retrying a server that is down does not run its self-checks (a thread, nvidia-smi, lspci) per
# attempt, and the profile is collected before connecting, so a socket admitted by a busy server does
# not sit on its admission slot while the device probes its hardware.
PROFILE_REUSE_S = 60.0


class _LinkDead(DeviceError, ConnectionError):
    pass


def _refusal_reason(body: bytes | bytearray | None) -> str | None:
    """The `error` of a refused handshake's `{"error": …}` body, if it has one (shortened, one line)."""
    try:
        error = json.loads(body or b"").get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, str) or not error:
        return None
    return " ".join(error.split())[:500]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def make_ssl_context(url: str, ca_file: str | None = None) -> ssl.SSLContext | None:
    """TLS settings for `url`: None for ws://; for wss:// the server's certificate and host name are
    verified against the system's CAs, or against `ca_file` (e.g. a self-signed server's cert)."""
    scheme = urlsplit(url).scheme
    if scheme == "ws":
        if ca_file:
            raise ValueError(f"a CA file was given but {url} is not a wss:// URL: nothing would be verified")
        return None
    if scheme != "wss":
        raise ValueError(f"{url}: the server URL must start with ws:// or wss://")
    return ssl.create_default_context(cafile=ca_file)


@dataclass(frozen=True)
class LinkSettings:
    """How a `DeviceConnection` retries, waits and buffers.

    `backoff_base`/`backoff_cap`: the exponential backoff between attempts (seconds, full jitter);
    `restart_spread`: the most the first attempt after a link that was up waits (a fleet spreads its
    reconnections after a server restart); `max_attempts`: failed attempts in a row before `run()` raises
    `RetriesExhausted` (None: never); `connect_timeout`: one attempt's handshake and registration;
    `stable_after`: how long a link must have stayed up for the backoff to start again from the base;
    `max_queued_events`: events kept while the link is slower than the tools (the oldest dropped);
    `record_size`/`record_bytes`: the finished calls remembered so a resent batch is answered, not rerun;
    `max_concurrent_sessions`: sessions whose batches run side by side."""

    backoff_base: float = 0.5
    backoff_cap: float = 30.0
    restart_spread: float = RESTART_SPREAD_S
    max_attempts: int | None = None
    connect_timeout: float = 10.0
    stable_after: float = 10.0
    max_queued_events: int = 1000
    record_size: int = 10_000
    record_bytes: int = DEFAULT_RECORD_BYTES
    max_concurrent_sessions: int = DEFAULT_MAX_CONCURRENT_SESSIONS


@dataclass(frozen=True)
class ServerTrust:
    """Which server certificate a `DeviceConnection` accepts on wss://: `ssl_context` (None: the system's
    CAs, see `make_ssl_context`) or exactly the certificate with the SHA-256 `tls_fingerprint`
    (`tether.device.link.tls_pin`; then `ssl_context` is not used)."""

    ssl_context: ssl.SSLContext | None = None
    tls_fingerprint: str | None = None


@dataclass(frozen=True)
class LinkHooks:
    """Who a `DeviceConnection` tells and asks: `on_state(state, connection)` hears each state change;
    `policy` answers the server's POLICY_REQUEST / POLICY_SET (None: refused); `questions` and `sampler`
    receive the answers to external MCP servers' questions and sampling requests (`tether.device.mcp.client.elicit`;
    None: such answers are dropped)."""

    on_state: StateHook | None = None
    policy: RemotePolicy | None = None
    questions: RemoteQuestions | None = None
    sampler: RemoteSampler | None = None


class DeviceConnection:
    """Keeps one device registered with the server and executes what it sends, until `stop()`."""

    def __init__(self, client: DeviceClient, url: str | Sequence[str], token: str | None, *, name: str | None = None,
                 profile: Callable[[], Awaitable[DeviceProfile]] | None = None, key: DeviceKey | None = None,
                 trust: ServerTrust = ServerTrust(), settings: LinkSettings = LinkSettings(),
                 hooks: LinkHooks = LinkHooks(), outbox: Outbox | None = None) -> None:
        """`client` runs the batches; `url` is the server's `ws(s)://…/aip` URL, or a cluster's nodes in the
        order to try them; `token` the device token; `name` the device name the token must match (None: the
        token's); `profile` collects what registration reports (None: an empty profile); `key` signs each
        registration's challenge (None: a key made for this connection, in memory only); `outbox` holds
        what the device owes the server (None: a new one holding `settings.max_queued_events` events; pass
        one to give a `RemoteSampler` its `put_control` before the connection exists).

        Raises ValueError for URLs it cannot use (not ws(s)://, ws:// and wss:// mixed, a TLS pin or a CA
        without wss://)."""
        # several URLs: a cluster's nodes, tried in turn when the one in use is lost (reconnect.ServerURLs)
        self.servers = ServerURLs([url] if isinstance(url, str) else list(url))
        # each URL's proxy (HTTPS_PROXY, NO_PROXY, …) decided once, as websockets' `connect(proxy=True)` would
        # decide it on every attempt (a scan of the environment: ~4% of a retrying fleet's CPU)
        self._proxies: dict[str, str | None] = {}
        for each in self.servers.urls:
            try:
                self._proxies[each] = get_proxy(parse_uri(each))
            except (InvalidURI, ValueError) as exc:
                raise ValueError(f"{each}: not a usable server URL ({exc}); it must look like ws(s)://host:port/aip") \
                    from None
        if len({urlsplit(each).scheme for each in self.servers.urls}) > 1:
            raise ValueError("the server URLs mix ws:// and wss://: give every node the same scheme")
        self.client = client
        self.name = name
        self.instance_id = uuid.uuid4().hex
        self._token = token
        # the device's key: every registration signs the server's challenge with it (protocol.identity). A
        # device that runs for long passes the one in its state directory (device_key.load_device_key); without
        # one, a key made for this connection (in memory only: enrolled by the first registration of a token
        # made without a key, and not this device's any more once the process is gone)
        self.key = key if key is not None else DeviceKey.generate()
        self._profile = profile
        self._pin = normalize_fingerprint(trust.tls_fingerprint) if trust.tls_fingerprint else None
        if self._pin and urlsplit(self.url).scheme != "wss":
            raise ValueError(f"a TLS fingerprint was given but {self.url} is not a wss:// URL: nothing would be "
                             "pinned")
        self._ssl = trust.ssl_context if trust.ssl_context is not None or self._pin else make_ssl_context(self.url)
        self.settings = settings
        self.hooks = hooks
        # observable state
        self.state: ConnectionState = "idle"
        self.connected = asyncio.Event()
        self.registered_as: str | None = None
        self.connections = 0
        self.last_error: str | None = None
        self.ack: RegisterAck | None = None
        self._failures = FailureLog(logger)  # thins the log of a long outage (reconnect.py)
        self._heartbeat_frame = HeartbeatFrame(name)
        # what outlives a connection
        self.outbox = outbox if outbox is not None else Outbox(settings.max_queued_events)
        self.record = FinishedRecord(settings.record_size, settings.record_bytes)
        self.batches = BatchRunner(client, self.outbox, self.record, client_id=name,
                                   max_concurrent_sessions=settings.max_concurrent_sessions)
        self._stop = asyncio.Event()
        self._pausing: asyncio.Future[None] | None = None  # the wait between attempts, ended early by stop()
        self._spare_profile: tuple[float, int, DeviceProfile] | None = None  # (loop time, version, profile)
        self._running = False
        self._last_rx = 0.0
        self._grace_until: float | None = None  # loop time the server's grace for our batches ends
        self._side_tasks: set[asyncio.Task[None]] = set()
        # the profile changes when an external MCP server joins after registration: counted, so a change
        # while the profile of a registration was being collected is sent once registered
        self._profile_version = 0
        self._registered_version = 0
        self._pushing: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ public control

    @property
    def url(self) -> str:
        """The server URL in use (or tried next)."""
        return self.servers.current

    def profile_changed(self) -> None:
        """The device's tools changed (an external MCP server has joined): the server gets the new
        profile now in an unasked DEVICE_INFO, or with the next registration if not registered."""
        self._profile_version += 1
        if self.state == "registered":
            self._push_profile()

    def _push_profile(self) -> None:
        if self._pushing is not None and not self._pushing.done():
            return  # the running push sends again if the version moved meanwhile
        self._pushing = asyncio.create_task(self._push_profile_until_current())
        self._side_tasks.add(self._pushing)
        self._pushing.add_done_callback(self._side_tasks.discard)

    async def _push_profile_until_current(self) -> None:
        while True:
            version = self._profile_version
            await self._send_device_info(None)
            if self._profile_version == version:
                return

    def stop(self) -> None:
        """Ask `run()` to finish: running batches are cancelled, their failures sent if possible.
        Safe to call before `run()` starts (it then returns at once); a stopped connection stays stopped."""
        self._stop.set()
        if self._pausing is not None:
            _resolve(self._pausing)

    async def run(self) -> None:
        """Connect, register and serve; reconnect on any loss until `stop()`.

        Raises `RegistrationRefused` for a refusal retrying cannot fix, and `RetriesExhausted` after
        `max_attempts` failed attempts in a row (never, by default).
        """
        if self._running:
            raise RuntimeError("this DeviceConnection is already running")
        self._running = True
        for url in self.servers.urls:
            local = urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")
            if self._ssl is None and not self._pin and self._token and not local:
                logger.warning("connecting to %s without TLS: the device token travels in clear text", url)
        attempt = failures = 0
        try:
            while not self._stop.is_set():
                self._set_state("connecting")
                retry_after: float | None = None
                try:
                    uptime = await self._session()
                except RegistrationRefused as exc:
                    self.last_error = str(exc)
                    if exc.fatal:
                        logger.error("%s", exc)
                        self._set_state("refused")
                        raise
                    self._failures.failed(self.url, str(exc), "%s: %s; retrying")
                    uptime = None
                except RETRYABLE as exc:
                    self.last_error = describe_failure(exc)
                    retry_after = retry_after_of(exc)  # a busy server (admission control) said when
                    self._failures.failed(self.url, self.last_error)
                    uptime = None
                except Exception as exc:  # a bug here must not take the device offline for good
                    self.last_error = describe_failure(exc)
                    logger.exception("unexpected error in the connection to %s", self.url)
                    uptime = None
                self._set_state("disconnected")
                if self._stop.is_set():
                    break
                if uptime is None:
                    failures += 1
                    if self.settings.max_attempts is not None and failures >= self.settings.max_attempts:
                        raise RetriesExhausted(f"gave up after {failures} failed attempt(s) to connect to "
                                               f"{self.url}: {self.last_error}")
                else:
                    failures = 0
                    if uptime >= self.settings.stable_after:
                        attempt = 0
                grace_left = self._grace_left()
                delay = backoff_delay(attempt, self.settings.backoff_base, self.settings.backoff_cap,
                                      grace_left=grace_left, retry_after=retry_after,
                                      spread=self.settings.restart_spread if uptime is not None else 0.0)
                # the next node; the wait grows once per round of them (refused as busy: the server's pace,
                # not a failure to back off from)
                if self.servers.advance() and retry_after is None:
                    attempt += 1
                target = f" to {self.url}" if len(self.servers.urls) > 1 else ""
                if grace_left is None:
                    logger.info("reconnecting%s in %.2fs", target, delay)
                else:
                    logger.info("reconnecting%s in %.2fs (%.1fs left of the server's grace period)", target, delay,
                                grace_left)
                await self._pause(delay)
        finally:
            await self.batches.abort_all()
            self._running = False
            if self.state != "refused":
                self._set_state("stopped")

    async def _pause(self, delay: float) -> None:
        """Wait `delay` seconds, or less if `stop()` is called: one future and one timer (an asyncio.timeout
        around `_stop.wait()` costs a task cancellation and two exceptions, per attempt of a retrying fleet)."""
        if self._stop.is_set():
            return
        loop = asyncio.get_running_loop()
        self._pausing = wake = loop.create_future()
        timer = loop.call_later(delay, _resolve, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._pausing = None

    @property
    def running_batches(self) -> int:
        return self.batches.running

    def _grace_left(self) -> float | None:
        """Seconds left of the grace period in which the server keeps this device's batches, while the
        device owes it something (results waiting, batches queued or running); None otherwise."""
        if self._grace_until is None or not (self.outbox.pending_results or self.batches.running):
            return None
        left = self._grace_until - asyncio.get_running_loop().time()
        return left if left > 0 else None

    # ------------------------------------------------------------------ one connection

    def _set_state(self, state: ConnectionState) -> None:
        self.state = state
        if self.hooks.on_state is not None:
            try:
                self.hooks.on_state(state, self)
            except Exception:
                logger.exception("connection state hook failed")

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
                               max_size=TRANSPORT_MAX_BYTES, ping_interval=KEEPALIVE_S, ping_timeout=KEEPALIVE_S,
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

    async def _serve(self, ws: ClientConnection, session: DeviceSession, ack: RegisterAck) -> float:
        loop = asyncio.get_running_loop()
        started = self._last_rx = loop.time()
        keepalive = getattr(ws, "keepalive_task", None)
        if max(ack.heartbeat_timeout, ack.heartbeat_interval) <= 2 * KEEPALIVE_S and keepalive is not None:
            # the heartbeat notices a silent server before the socket's keepalive could (a ping every
            # KEEPALIVE_S, a pong awaited as long): its pings would only cost both sides a frame and a timer
            keepalive.cancel()
        self.outbox.open(ack.max_frame_bytes)
        self.connected.set()
        self._set_state("registered")
        if self._profile_version != self._registered_version:  # a server joined while we registered
            self._push_profile()
        stopper = asyncio.create_task(self._stop.wait())
        # The socket's reader may hand the socket over to a new reader and become a batch's task (see
        # `_reader`): `reading` ends when the reader of the moment ends, however it ends.
        reading: asyncio.Future[None] = loop.create_future()
        readers: set[asyncio.Task[None]] = set()

        def reader_done(task: asyncio.Task[None]) -> None:
            if task not in readers or reading.done():  # one that handed over: a batch's task now
                return
            readers.discard(task)
            if task.cancelled():
                reading.cancel()
            elif task.exception() is not None:
                reading.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                reading.set_result(None)

        def start_reader() -> None:
            task = asyncio.create_task(self._reader(ws, session, hand_over))
            readers.add(task)
            task.add_done_callback(reader_done)

        def hand_over() -> None:
            readers.discard(asyncio.current_task())
            start_reader()

        start_reader()
        tasks: set[asyncio.Future[Any]] = {reading, asyncio.create_task(self._sender(ws)),
                                           asyncio.create_task(self._heartbeat(ws, ack)), stopper}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:  # say goodbye properly: failures of cancelled batches first
                await self.batches.abort_all()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        await self.outbox.idle.wait()
                self.last_error = None
            else:
                failed = [exc for t in done if (exc := t.exception()) is not None]
                self.last_error = (describe_failure(failed[0]) if failed else
                                   f"the server closed the connection ({ws.close_code}"
                                   f"{': ' + ws.close_reason if ws.close_reason else ''})")
                logger.warning("connection to %s lost: %s", self.url, self.last_error)
        finally:
            # from now on the server keeps our batches for its grace period (it may have noticed the loss
            # a little later than we did, never much earlier: heartbeats bound both sides alike)
            self._grace_until = loop.time() + ack.grace_period
            self.connected.clear()
            self.outbox.close()
            for task in (*tasks, *readers, *self._side_tasks):
                task.cancel()
            await asyncio.gather(*tasks, *readers, *self._side_tasks, return_exceptions=True)
            session.closed(ws.close_code)
            if ws.transport is not None and not ws.transport.is_closing() and self.last_error:
                ws.transport.abort()  # a dead link would only make the closing handshake wait
        return loop.time() - started

    async def _reader(self, ws: ClientConnection, session: DeviceSession, hand_over: Callable[[], None]) -> None:
        """Read frames until the socket closes and act on what `session` says each one means. A COMMAND that can
        start at once runs right here, in this task (most finish without waiting: no task, no event-loop turn
        on the round trip); if it has to wait, `hand_over` gives the socket to a new reader first, and this
        task ends with the batch."""
        loop = asyncio.get_running_loop()
        receive = session.receive_open
        while True:
            try:
                raw = await ws.recv()
            except ConnectionClosedOK:
                return
            self._last_rx = loop.time()
            event = receive(raw)
            if type(event) is HeartbeatAck:
                self.outbox.heartbeat_answered()  # the results written before our heartbeat are the server's
            elif type(event) is CommandsArrived:
                batch = self.batches.submit(event.batch, run_here=True)
                if batch is not None and await run_in_this_task(batch, hand_over):
                    return
            else:
                self._act(session, event)

    def _act(self, session: DeviceSession, event: SessionEvent) -> None:
        """Do what a server message other than a COMMAND or a heartbeat asks."""
        if isinstance(event, BadFrame):
            logger.warning("bad frame from the server (%s): %s", event.reason, event.error)
            self.outbox.put_control(session.error_frame(f"{event.reason}: {event.error}"))
        elif isinstance(event, CancelArrived):
            if not self.batches.cancel(event.response_id):
                logger.info("cancel for %s: no such batch queued or running", event.response_id)
        elif isinstance(event, HeartbeatAck):  # liveness was noted on arrival
            self.outbox.heartbeat_answered()
        elif isinstance(event, PolicyRequest):
            self._answer_policy(event.message)
        elif isinstance(event, OutcomeQuery):
            self._answer_outcomes(event)
        elif isinstance(event, ProfileRequested):
            task = asyncio.create_task(self._send_device_info(event.response_id))
            self._side_tasks.add(task)
            task.add_done_callback(self._side_tasks.discard)
        elif isinstance(event, ElicitationAnswer):
            if self.hooks.questions is not None:
                self.hooks.questions.answer(event.payload)
        elif isinstance(event, SamplingReply):
            if self.hooks.sampler is not None:
                self.hooks.sampler.reply(event.message)
        elif isinstance(event, ServerReportedError):
            logger.warning("the server reports an error: %s", event.error)
        elif isinstance(event, Unexpected):
            logger.info("ignoring an unexpected %s from the server", event.type.value)
        elif isinstance(event, CommandsArrived):
            self.batches.submit(event.batch)

    def _answer_policy(self, msg: ServerMessage) -> None:
        """Show or change the policy for the server (`tether policy`): one POLICY_REPORT either way; a
        refused or invalid change is a FAILED report saying why, and changes nothing."""
        reply = ClientMessage(type=ClientMessageType.POLICY_REPORT, client_id=self.name,
                              prev_response_id=msg.response_id)
        policy = self.hooks.policy
        try:
            if policy is None:
                raise ValueError("this device does not take policy requests from its server")
            if msg.type is ServerMessageType.POLICY_SET:
                payload = msg.payload or {}
                reply.payload = policy.apply(payload.get("policy") or {}, replace=payload.get("replace") is True)
            else:
                reply.payload = policy.report()
        except ValueError as exc:
            reply.status, reply.error = TaskStatus.FAILED, str(exc)[:2000]
        except OSError as exc:
            reply.status, reply.error = TaskStatus.FAILED, f"the device could not save its policy: {exc}"
        self.outbox.put_control(encode(reply))

    def _answer_outcomes(self, query: OutcomeQuery) -> None:
        """An OUTCOME_QUERY: one OUTCOME_REPORT from the record of finished calls and the batches in hand;
        nothing is run, queued or changed for it (a finished result stays in the outbox until acknowledged)."""
        outcomes = [self.batches.outcome_of(call.call_id, call.response_id).model_dump(mode="json", exclude_none=True)
                    for call in query.calls]
        self.outbox.put_control(encode(ClientMessage(type=ClientMessageType.OUTCOME_REPORT, client_id=self.name,
                                                     prev_response_id=query.response_id,
                                                     payload={"outcomes": outcomes})))

    async def _send_device_info(self, response_id: str | None) -> None:
        profile = await self._collect_profile()
        self.outbox.put_control(encode(ClientMessage(type=ClientMessageType.DEVICE_INFO, client_id=self.name,
                                                     prev_response_id=response_id,
                                                     payload=profile.model_dump(mode="json"))))

    async def _sender(self, ws: ClientConnection) -> None:
        outbox = self.outbox

        def write_now(text: str) -> bool:
            # what `ws.send` does for a text frame when nothing is buffered, without the await; a
            # socket that is closing or has a backlog is left to the sender
            if ws.state is not State.OPEN or ws.transport.get_write_buffer_size():
                return False
            ws.protocol.send_text(text.encode())
            ws.send_data()
            return True

        while True:
            frame = outbox.pop()
            if frame is None:
                outbox.wait_state()
                outbox.write_now = write_now
                try:
                    await outbox.ready.wait()
                finally:
                    outbox.write_now = None
                continue
            try:
                await ws.send(frame[1])
                outbox.written(frame)  # a result is kept until the server acknowledges it (Outbox)
            except BaseException:
                # The frame may or may not have left: a result stays owed (at least once; the server
                # ignores a second result for a call it already has), an event is let go.
                outbox.push_back(frame)
                raise

    async def _heartbeat(self, ws: ClientConnection, ack: RegisterAck) -> None:
        """Send heartbeats every `heartbeat_interval`; no frame at all for `heartbeat_timeout` means
        the link is dead even if TCP has not noticed (a silent server, a vanished NAT entry).

        A beat is skipped when frames went both ways since the last one and the load it would report
        is what the last beat said (`keepalive.beat_due`)."""
        loop = asyncio.get_running_loop()
        interval = max(ack.heartbeat_interval, 0.01)  # a careless ACK must not make this spin
        timeout = max(ack.heartbeat_timeout, interval)
        if self._heartbeat_frame.client_id != self.name:  # renamed since: the template follows
            self._heartbeat_frame = HeartbeatFrame(self.name)
        beat, batches, outbox = self._heartbeat_frame, self.batches, self.outbox
        next_beat = loop.time() + interval  # the outbox goes first after registering
        said: tuple[int, int] | None = None  # (running, queued) as the last beat told them
        puts = outbox.puts
        while True:
            now = loop.time()
            if now - self._last_rx > timeout:
                raise _LinkDead(f"nothing from the server for {now - self._last_rx:.1f}s "
                                f"(heartbeat timeout {timeout:g}s)")
            if now >= next_beat:
                news = (batches.running, batches.queued)
                # results waiting for the acknowledgement only a beat's answer brings: as if nothing was sent
                if beat_due(outbox.puts != puts and not outbox.unacked, now - self._last_rx, interval, news, said):
                    outbox.put_heartbeat(beat(*news))
                    said = news
                puts = outbox.puts
                next_beat = now + interval
            # asleep until the next beat or the moment the silence would pass the timeout, whichever is
            # first (a frame arriving meanwhile moves that moment on: checked again on waking)
            wake = min(next_beat, self._last_rx + timeout)
            await asyncio.sleep(max(wake - now, 0.0) + 0.001)
