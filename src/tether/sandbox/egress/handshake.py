"""The egress proxy's wire formats: reading a request head (HTTP CONNECT, HTTP forward, SOCKS5) off a raw
socket within a deadline and a size cap, and writing refusals. Standard library only."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tether.errors import SandboxError
from tether.sandbox.egress.rules import normalize_host


class Refused(SandboxError):
    """The connection is not made; `code` is the HTTP status, `socks` the SOCKS5 reply code."""

    def __init__(self, rule: str, reason: str, *, code: int = 403, socks: int = 2) -> None:
        super().__init__(reason)
        self.rule, self.reason, self.code, self.socks = rule, reason, code, socks


@dataclass(slots=True)
class Request:
    """What a connection asked for: its dialect (`connect`, `http`, `socks5`), host and port, and for a
    forward HTTP request the head to send upstream."""

    protocol: str = "tcp"
    host: str = "?"
    port: int = 0
    upstream_head: bytes | None = None


class Head:
    """Reads a connection's first bytes off its raw socket, within one deadline and one size cap."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, *, timeout_s: float,
                 max_bytes: int) -> None:
        self.loop, self.sock, self.timeout_s, self.max_bytes = loop, sock, timeout_s, max_bytes
        self.buf = bytearray()
        self.deadline = loop.time() + timeout_s

    async def _more(self) -> None:
        if len(self.buf) >= self.max_bytes:
            raise Refused("network.request-too-large", f"the request head is over {self.max_bytes} "
                                                       "bytes", code=431, socks=1)
        remaining = self.deadline - self.loop.time()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                data = await self.loop.sock_recv(self.sock, self.max_bytes - len(self.buf))
        except TimeoutError:
            raise Refused("network.request-timeout", f"no complete request within {self.timeout_s:g}s",
                          code=408, socks=1) from None
        if not data:
            raise ConnectionResetError("the client closed the connection")
        self.buf += data

    async def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._more()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def until(self, marker: bytes) -> bytes:
        while (end := self.buf.find(marker)) < 0:
            await self._more()
        out = bytes(self.buf[:end + len(marker)])
        del self.buf[:end + len(marker)]
        return out


async def socks_request(head: Head, request: Request, send: Callable[[bytes], Awaitable[None]]) -> None:
    """Read a SOCKS5 greeting and CONNECT request into `request`, answering the greeting with `send`."""
    _, count = await head.exactly(2)
    methods = await head.exactly(count)
    if 0 not in methods:
        await send(b"\x05\xff")
        raise ConnectionResetError("the SOCKS client offers no method without authentication")
    await send(b"\x05\x00")
    version, command, _, atyp = await head.exactly(4)
    if atyp == 1:
        host = str(ipaddress.IPv4Address(await head.exactly(4)))
    elif atyp == 4:
        host = str(ipaddress.IPv6Address(await head.exactly(16)))
    elif atyp == 3:
        (length,) = await head.exactly(1)
        try:
            host = (await head.exactly(length)).decode("ascii")
        except UnicodeDecodeError:
            raise Refused("network.bad-request", "a SOCKS host name must be ASCII (IDNA-encoded)",
                          code=400, socks=1) from None
    else:
        raise Refused("network.socks", f"SOCKS address type {atyp} is not supported", code=400, socks=8)
    port = int.from_bytes(await head.exactly(2), "big")
    request.host, request.port = normalize_host(host), port
    if version != 5 or command != 1:
        raise Refused("network.socks", "only SOCKS5 CONNECT is supported (no BIND, no UDP)", code=400, socks=7)

async def http_request(head: Head, request: Request) -> None:
    """Read an HTTP proxy request head into `request`: CONNECT, or a forward request whose head to send
    upstream (origin-form, `Connection: close`, no `Proxy-*` headers) is `request.upstream_head`."""
    raw = await head.until(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise Refused("network.bad-request", "not an HTTP proxy request", code=400)
    method, target, version = parts
    if method == "CONNECT":
        request.protocol = "connect"
        request.host, request.port = host_port(target, None)
        return
    request.protocol = "http"
    if not target.lower().startswith("http://"):
        raise Refused("network.bad-request", "a forward-proxy request needs an absolute http:// URL (use CONNECT "
                                             "for https)", code=400)
    rest = target[len("http://"):]
    slash = rest.find("/")
    authority, path = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
    if "@" in authority:
        raise Refused("network.bad-request", "credentials in a proxied URL are not forwarded", code=400)
    request.host, request.port = host_port(authority, 80)
    headers = [line for line in lines[1:] if line and not line.lower().startswith(
        ("proxy-connection:", "proxy-authorization:", "connection:", "keep-alive:"))]
    # one request per upstream connection: a client reusing it for another host would otherwise reach
    # this host with that request
    out = "\r\n".join([f"{method} {path} {version}", *headers, "Connection: close", "", ""])
    request.upstream_head = out.encode("latin-1")


def host_port(authority: str, default: int | None) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or (with a default port) `host`, normalized; Refused when malformed."""
    if authority.startswith("["):
        close = authority.find("]")
        host, rest = authority[1:close], authority[close + 1:]
        port_text = rest[1:] if rest.startswith(":") else ""
    elif authority.count(":") == 1:
        host, port_text = authority.split(":")
    else:
        host, port_text = authority, ""
    if not port_text:
        if default is None:
            raise Refused("network.bad-request", f"{authority!r} has no port", code=400)
        return normalize_host(host), default
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise Refused("network.bad-request", f"{authority!r} has no valid port", code=400)
    return normalize_host(host), int(port_text)


_STATUS = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 502: "Bad Gateway", 504: "Gateway Timeout"}


def http_refusal(refusal: Refused) -> bytes:
    """The HTTP answer to a refused request: its status, `X-Tether-Rule`, and a JSON body `{error, rule}`."""
    body = json.dumps({"error": f"tether egress proxy: {refusal.reason}", "rule": refusal.rule}).encode()
    rule = refusal.rule.encode("ascii", "replace").replace(b"\r", b" ").replace(b"\n", b" ")
    return (f"HTTP/1.1 {refusal.code} {_STATUS.get(refusal.code, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + b"X-Tether-Rule: " + rule + \
        b"\r\n\r\n" + body


def socks_reply(code: int) -> bytes:
    """A SOCKS5 reply with `code` (0: succeeded, 2: not allowed by ruleset...) and an empty bound address."""
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])
