"""The egress proxy: the only way out for a sandbox whose policy lists hosts (`network: {allow: [...]}`).

The sandbox has its own network namespace with nothing but loopback in it; the warden listens on a
port of that loopback and hands the listening socket to the device, where `EgressProxy.serve`
accepts from it. Every connection speaks one of three dialects, told apart by its first byte:
HTTP `CONNECT host:port` (tunnels: TLS), a plain HTTP forward-proxy request (`GET http://host/...`)
or SOCKS5 (CONNECT only, names resolved here: `socks5h`); `handshake` reads them. For each one the
proxy

1. judges the requested name against the rules (`EgressRules.judge_name`: deny, then allow);
2. resolves it itself and judges every address (`judge_address`: no loopback, private, link-local or
   other special address unless the rules name it), then connects to an address it judged, never
   to the name (no second resolution that could answer differently);
3. relays bytes both ways (`relay`: splice, no copy), counting them, until both sides have
   ended, either fails, or the connection is idle.

A refusal reaches the command: an HTTP 403 with a JSON body `{"error", "rule"}` and an
`X-Tether-Rule` header, or a SOCKS5 reply code 2 ("not allowed by ruleset"). Every connection,
allowed or not, is reported to `audit` when it is judged and again when it ends (with its bytes).

Every wait is bounded: the request head (`Limits.head_timeout_s`, at most `Limits.max_head_bytes`),
resolution, connecting, a person's answer, and an idle relay. Standard library only.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import select
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from tether.sandbox.egress.handshake import (
    Head,
    Refused,
    Request,
    http_refusal,
    http_request,
    socks_reply,
    socks_request,
)
from tether.sandbox.egress.relay import Relay
from tether.sandbox.egress.rules import EgressRules, IPAddress, Verdict, parse_address, valid_host

logger = logging.getLogger("tether.sandbox.egress")  # the package's name: the log docs/security/network.md names
ACCEPT_RETRY_S = 1.0

Answer = Literal["once", "always", "deny"]
AskFn = Callable[[str, int, int | None], Awaitable[Answer | None]]  # None: nobody can answer


@dataclass(frozen=True, slots=True)
class Limits:
    """Time limits and size caps on everything the proxy waits for."""

    head_timeout_s: float = 10.0  # the request head (HTTP headers, SOCKS handshake), in all
    max_head_bytes: int = 32 * 1024
    resolve_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0  # no byte either way for this long ends a tunnel
    ask_timeout_s: float = 300.0  # a person's answer to `ask: on-miss`
    max_connections: int = 96  # open at once, all commands together; more wait to be accepted
    max_per_command: int = 32  # open at once by one command; more are refused
    chunk_bytes: int = 256 * 1024
    splice: bool = True  # move bytes with splice(2); False: recv_into/send through a buffer


@dataclass(slots=True)
class EgressRecord:
    """The audit record of one connection: what was asked, the verdict and its rule, the bytes moved.

    `up` counts bytes from the command to the host, `down` from the host to the command; both grow
    while the connection is open. `owner` is the sandbox's request id of the command that opened it,
    when it could be told.
    """

    protocol: str
    host: str
    port: int
    allowed: bool = False
    rule: str = ""
    reason: str = ""
    address: str | None = None
    owner: int | None = None
    up: int = 0
    down: int = 0
    started: float = field(default_factory=time.time)
    ended: float | None = None

    def describe(self) -> str:
        """One line for a log or a command's notes."""
        where = f"{self.host}:{self.port}" + (f" ({self.address})" if self.address and self.address != self.host
                                               else "")
        if not self.allowed:
            return f"network: {where} refused by {self.rule}: {self.reason}"
        return f"network: {where} allowed by {self.rule}, {self.up} bytes up, {self.down} down ({self.protocol})"

    def as_dict(self) -> dict[str, object]:
        return {"protocol": self.protocol, "host": self.host, "port": self.port, "address": self.address,
                "allowed": self.allowed, "rule": self.rule, "reason": self.reason, "bytes_up": self.up,
                "bytes_down": self.down, "owner": self.owner, "started": self.started, "ended": self.ended}


class EgressProxy:
    """Serves the connections a sandbox makes, under `rules`.

    `audit(record, event)` is called with event "open" once a connection is judged (allowed or not)
    and "close" when it ends. `owner(peer)` names the command (its request id) that holds the client
    end `peer` (an (address, port) pair on the sandbox's loopback), or None. `ask(host, port, owner)`
    asks a person about an unlisted host when the rules say `ask: on-miss`; without it such a host is
    refused. An "always" answer is kept for this proxy's life (`rules` grows an exact entry).
    """

    def __init__(self, rules: EgressRules, *, audit: Callable[[EgressRecord, str], None] | None = None,
                 owner: Callable[[tuple[str, int]], Awaitable[int | None]] | None = None, ask: AskFn | None = None,
                 limits: Limits | None = None) -> None:
        self.rules = rules
        self.audit, self.owner, self.ask = audit, owner, ask
        self.limits = limits or Limits()
        self._tasks: set[asyncio.Task[None]] = set()
        self._servers: list[asyncio.Task[None]] = []
        self._slot = asyncio.Event()  # set when a connection ends
        self._per_owner: dict[int | None, int] = {}  # open connections per command

    # ------------------------------------------------------------------ accepting

    def serve(self, listener: socket.socket) -> asyncio.Task[None]:
        """Accept from `listener` (a listening TCP socket, the proxy now owns it) until `aclose`, or until
        the returned task is cancelled (a sandbox that restarted gets a new listener)."""
        listener.setblocking(False)
        task = asyncio.get_running_loop().create_task(self._accept_loop(listener))
        self._servers.append(task)
        task.add_done_callback(self._forget_server)
        return task

    def _forget_server(self, task: asyncio.Task[None]) -> None:
        if task in self._servers:
            self._servers.remove(task)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if len(self._tasks) >= self.limits.max_connections:
                    await self._wait_for_a_slot()  # the rest wait in the listen backlog
                    continue
                try:
                    client, peer = await loop.sock_accept(listener)
                except OSError as exc:  # out of file descriptors, say: wait until a connection ends
                    logger.warning("egress proxy: cannot accept a connection: %s", exc)
                    await self._wait_for_a_slot()
                    continue
                task = loop.create_task(self.handle(client, (str(peer[0]), int(peer[1]))))
                self._tasks.add(task)
                task.add_done_callback(self._ended)
        finally:
            listener.close()

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slot.set()

    async def _wait_for_a_slot(self) -> None:
        """Until one of the open connections ends (at most ACCEPT_RETRY_S when none is open to end)."""
        self._slot.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(None if self._tasks else ACCEPT_RETRY_S):
                await self._slot.wait()

    async def aclose(self) -> None:
        """Stop accepting and end every open connection."""
        for task in (*self._servers, *self._tasks):
            task.cancel()
        await asyncio.gather(*self._servers, *self._tasks, return_exceptions=True)
        self._servers.clear()

    def _report(self, record: EgressRecord, event: str) -> None:
        if self.audit is not None:
            try:
                self.audit(record, event)
            except Exception:  # an audit sink's bug must not take the connection's task down
                pass

    # ------------------------------------------------------------------ one connection

    async def handle(self, client: socket.socket, peer: tuple[str, int]) -> None:
        """Serve one accepted connection to its end (the proxy owns and closes `client`)."""
        loop = asyncio.get_running_loop()
        client.setblocking(False)
        with contextlib.suppress(OSError):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = Head(loop, client, timeout_s=self.limits.head_timeout_s, max_bytes=self.limits.max_head_bytes)
        request = Request()
        record = EgressRecord("tcp", "?", 0)
        upstream: socket.socket | None = None
        opened = False
        counted: tuple[int | None] | None = None  # (owner,) once this connection is counted for its owner
        try:
            first = await head.exactly(1)
            record.owner = await self._owner(peer)  # after a first byte: the command's start is known by now
            counted = (record.owner,)
            self._per_owner[record.owner] = self._per_owner.get(record.owner, 0) + 1
            socks = first == b"\x05"
            head.buf[:0] = first
            try:
                if socks:
                    request.protocol = "socks5"
                    await socks_request(head, request, lambda data: self._send(loop, client, data))
                else:
                    await http_request(head, request)
                record.protocol, record.host, record.port = request.protocol, request.host, request.port
                upstream = await self._open(record)
                opened = True
                if socks:
                    await self._send(loop, client, socks_reply(0))
                elif request.upstream_head is None:
                    await self._send(loop, client, b"HTTP/1.1 200 Connection established\r\n\r\n")
                early = request.upstream_head or b""
            except Refused as refusal:
                record.protocol, record.host, record.port = request.protocol, request.host, request.port
                record.allowed, record.rule, record.reason = False, refusal.rule, refusal.reason
                if not opened:
                    opened = True
                    self._report(record, "open")
                reply = socks_reply(refusal.socks) if socks else http_refusal(refusal)
                with contextlib.suppress(OSError, TimeoutError):
                    await self._send(loop, client, reply)
                    await self._linger(loop, client)
                return
            early += head.buf  # what the client sent after its request head (a body, a TLS hello)
            if early:
                await self._send(loop, upstream, early)
                record.up += len(early)

            def up(n: int) -> None:
                record.up += n

            def down(n: int) -> None:
                record.down += n

            await Relay(client, upstream, up=up, down=down, idle_timeout_s=self.limits.idle_timeout_s,
                        chunk=self.limits.chunk_bytes, splice=self.limits.splice).run()
        except (ConnectionError, OSError, Refused, ValueError):
            pass  # the client went away, or spoke nonsense before a verdict: nothing was opened
        finally:
            if upstream is not None:
                upstream.close()
            client.close()
            if counted is not None:
                left = self._per_owner.pop(counted[0], 1) - 1
                if left:
                    self._per_owner[counted[0]] = left
            if opened:
                record.ended = time.time()
                self._report(record, "close")

    async def _owner(self, peer: tuple[str, int]) -> int | None:
        if self.owner is None:
            return None
        try:
            async with asyncio.timeout(self.limits.head_timeout_s):
                return await self.owner(peer)
        except Exception:
            return None

    async def _linger(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        """After a refusal: end our side and read (and drop) what the client still sends, briefly, so that
        closing with unread bytes does not reset the connection before the client has read the reply."""
        sock.shutdown(socket.SHUT_WR)
        budget = self.limits.max_head_bytes
        async with asyncio.timeout(min(1.0, self.limits.head_timeout_s)):
            while budget > 0 and (data := await loop.sock_recv(sock, budget)):
                budget -= len(data)

    async def _send(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
        async with asyncio.timeout(self.limits.head_timeout_s):
            await loop.sock_sendall(sock, data)

    # ------------------------------------------------------------------ verdicts and connecting

    async def _judge(self, record: EgressRecord) -> Verdict:
        verdict = self.rules.judge_name(record.host, record.port)
        if verdict.allowed or not verdict.ask or self.ask is None:
            return verdict
        try:
            async with asyncio.timeout(self.limits.ask_timeout_s):
                answer = await self.ask(record.host, record.port, record.owner)
        except TimeoutError as exc:  # the asker's own bound says how long it waited
            return Verdict(False, "network.ask", str(exc) or f"nobody answered within {self.limits.ask_timeout_s:g}s")
        except Exception as exc:  # a broken asker refuses; it does not take the connection's task down
            return Verdict(False, "network.ask", f"the question could not be asked: {exc}")
        if answer is None:
            return verdict
        if answer == "always":
            self.rules = self.rules.with_allowed(record.host, record.port)
        if answer in ("once", "always"):
            return Verdict(True, f"network.ask: {answer}", "a person allowed it")
        return Verdict(False, "network.ask: deny", "a person refused it")

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        literal = parse_address(host)
        if literal is not None:
            return [literal]
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.limits.resolve_timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except TimeoutError:
            raise Refused("network.resolve", f"{host} did not resolve within {self.limits.resolve_timeout_s:g}s",
                          code=504, socks=4) from None
        except OSError as exc:
            raise Refused("network.resolve", f"{host} does not resolve: {exc}", code=502, socks=4) from None
        out: list[IPAddress] = []
        for info in infos:
            address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            if address not in out:
                out.append(address)
        return out

    async def _open(self, record: EgressRecord) -> socket.socket:
        """Judge, resolve and connect; reports the verdict ("open"). Refused when it may not, or cannot."""
        if not valid_host(record.host) or not 0 < record.port < 65536:
            raise Refused("network.bad-request", f"{record.host[:100]!r}:{record.port} is not a host and port to "
                                                 "connect to", code=400, socks=1)
        if self._per_owner.get(record.owner, 0) > self.limits.max_per_command:
            raise Refused("network.max-connections", f"the command has more than {self.limits.max_per_command} "
                                                     "connections open", code=429, socks=1)
        verdict = await self._judge(record)
        if not verdict.allowed:
            raise Refused(verdict.rule, verdict.reason)
        name_rule = verdict.rule
        refusal: Verdict | None = None
        checked: list[tuple[IPAddress, Verdict]] = []
        for address in await self._resolve(record.host, record.port):
            on_address = self.rules.judge_address(record.host, address, record.port)
            if on_address.allowed:
                checked.append((address, on_address))
            elif refusal is None:
                refusal = on_address
        if not checked:
            assert refusal is not None
            raise Refused(refusal.rule, refusal.reason)
        loop = asyncio.get_running_loop()
        failure = ""
        for address, on_address in checked:  # connect to what was judged, never to the name again
            family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
            upstream = socket.socket(family, socket.SOCK_STREAM)
            upstream.setblocking(False)
            try:
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                async with asyncio.timeout(self.limits.connect_timeout_s):
                    await _connect(loop, upstream, (str(address), record.port))
            except TimeoutError:
                upstream.close()
                failure = f"{address}:{record.port} did not answer within {self.limits.connect_timeout_s:g}s"
                continue
            except OSError as exc:
                upstream.close()
                failure = f"{address}:{record.port}: {exc.strerror or exc}"
                continue
            except BaseException:
                upstream.close()
                raise
            record.address = str(address)
            record.allowed = True
            # the rule that let the name through, and the one that opened a special address if another did
            record.rule = name_rule if on_address.rule in ("network.public-address", name_rule) \
                else f"{name_rule}; {on_address.rule}"
            record.reason = verdict.reason
            self._report(record, "open")
            return upstream
        raise Refused("network.connect", f"could not connect: {failure}", code=502, socks=5)


async def _connect(loop: asyncio.AbstractEventLoop, sock: socket.socket, address: tuple[str, int]) -> None:
    """Connect the non-blocking `sock` to `address`, as `loop.sock_connect` does, but without a turn of the event
    loop when the peer has answered within the connect call itself (a host on this machine's loopback or a
    near one: the handshake ran in the kernel before connect() returned). OSError when it cannot connect."""
    try:
        sock.connect(address)
        return
    except BlockingIOError:
        pass
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    if poller.poll(0):  # the handshake is over, one way or the other: its outcome is in SO_ERROR
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))
        return
    try:
        await loop.sock_connect(sock, address)  # connect() again says EALREADY: it waits for the outcome
    except OSError as exc:
        if exc.errno != errno.EISCONN:  # it got through between the poll and this call
            raise
