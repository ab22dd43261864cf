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
under a cap (so a fleet of devices does not reconnect in lockstep after a server restart;
`reconnect.Backoff` is the schedule, docs/reconnect.md says it for operators). A
refusal that retrying cannot fix — bad token, name mismatch, unsupported version — stops `run()`
with `RegistrationRefused` carrying the server's words; "that device is already connected"
(4409) is retried, since the other connection may be this device's own dead one. That policy is
in `tether.device.link.reconnect`. While the device owes the server something (results in the outbox,
batches queued or running), the waits are also held well inside the grace period the server's
last RegisterAck promised (counted from the moment the link was lost), so a server that is
reachable again gets the results before it gives the batches up; those dense attempts do not raise
the backoff's step, so when the window closes the device goes on from its first step, not from the
cap. A long outage is logged once per kind of failure, then once a minute, then its end
(`reconnect.FailureLog`).

An idle link costs one heartbeat frame each way per interval and nothing else: the heartbeat is
written from a template, the server's reply recognised by its shape (`codec.HeartbeatFrame`,
`codec.is_server_heartbeat`), and the socket's own keepalive pings are stopped when the heartbeat
would notice a silent server first.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from websockets.exceptions import InvalidURI
from websockets.proxy import get_proxy
from websockets.uri import parse_uri

from tether.device.client import DeviceClient
from tether.device.link.batch_runner import BatchRunner
from tether.device.link.conn.reader import Dispatching
from tether.device.link.conn.register import Registering
from tether.device.link.conn.serve import Serving
from tether.device.link.finished import FinishedRecord
from tether.device.link.outbox import Outbox
from tether.device.link.reconnect import (
    RETRYABLE,
    Backoff,
    FailureLog,
    RegistrationRefused,
    RetriesExhausted,
    ServerURLs,
    backoff_delay,
    describe_failure,
    retry_after_of,
)
from tether.device.link.settings import (
    KEEPALIVE_S,
    PROFILE_REUSE_S,
    TRANSPORT_MAX_BYTES,
    ConnectionState,
    LinkSettings,
    ServerTrust,
    StateHook,
    make_ssl_context,
)
from tether.device.link.trust.device_key import DeviceKey
from tether.device.link.trust.tls_pin import normalize_fingerprint
from tether.device.mcp.client.elicit import RemoteQuestions, RemoteSampler
from tether.device.policy_overlay import RemotePolicy
from tether.protocol.codec import HeartbeatFrame
from tether.protocol.messages import RegisterAck
from tether.protocol.profile import DeviceProfile

__all__ = ["KEEPALIVE_S", "PROFILE_REUSE_S", "TRANSPORT_MAX_BYTES", "ConnectionState", "DeviceConnection",
           "LinkHooks", "LinkSettings", "RegistrationRefused", "RetriesExhausted", "ServerTrust", "StateHook",
           "backoff_delay", "make_ssl_context"]

logger = logging.getLogger(__name__)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)



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



class DeviceConnection(Registering, Dispatching, Serving):
    """Keeps one device registered with the server and executes what it sends, until `stop()`."""

    hooks: LinkHooks

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
        s = self.settings
        backoff = Backoff(s.backoff_base, s.backoff_cap, s.restart_spread, s.stable_after)
        failures = 0
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
                grace_left = self._grace_left()
                # the next node; the wait grows once per round of them (refused as busy: the server's pace,
                # not a failure to back off from), and not while a grace window paces the attempts
                delay = backoff.next_wait(uptime=uptime, round_done=self.servers.advance(), grace_left=grace_left,
                                          retry_after=retry_after)
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
