"""The transport edge: connections per client address capped as they are accepted, and HTTP's header,
body and idle timeouts.

A TCP connection that never sends a byte never reaches ASGI, so nothing in the app can refuse it:
with uvicorn's defaults about 1,010 such connections held a server's every file descriptor at the
common 1,024 limit. The caps and timers therefore live in the protocol classes uvicorn runs:

- `ConnectionCaps` counts, per client address, the HTTP connections (`max_connections_per_address`,
  `max_connections_per_loopback` for 127.0.0.0/8 and ::1, by default half the open-file limit;
  and `max_connections` for all addresses together, by default three quarters of it) and, separately, the WebSockets
  (`max_sockets_per_address`, `max_sockets_per_loopback`: a fleet behind one NAT address, or the
  benches' 10,000 local devices, holds many). A connection over its address's HTTP cap is aborted as
  it is accepted (its descriptor freed at once, nothing read); a WebSocket upgrade over the socket cap
  is answered 503 `{"error": …}` with `Retry-After` and closed. An upgraded connection moves from the
  first count to the second.
- `internals.edge_http_protocol(base, …)` wraps uvicorn's HTTP protocol: a new connection must start a request
  within `idle_timeout` (the keep-alive wait between requests is the same setting); a request's headers
  must be complete within `header_timeout` of its first byte, its body within `body_timeout` of its
  headers. Past either the client gets 408 `{"error": …}` (when no answer has started) and the
  connection is closed. No timer runs while the app works on a request: long polls and event streams
  are the app's to bound.
- `internals.edge_ws_protocol(base, caps)` wraps uvicorn's WebSocket protocol so a closed socket gives its
  address's place back. An AIP socket's own silence is bounded by the hub (`register_timeout`, then
  `heartbeat_timeout`).

Under TLS asyncio hands a connection to the protocol once its TLS handshake is done (and gives a
handshake 60 s), so a connection is counted from then on.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from typing import Any

from tether.server.settings import ServerSettings

logger = logging.getLogger(__name__)

_STATUS = {400: b"400 Bad Request", 408: b"408 Request Timeout", 503: b"503 Service Unavailable"}
SOCKET_RETRY_AFTER = 5  # seconds a device refused at the socket cap is told to wait


def is_loopback_address(address: str) -> bool:
    """Whether a peer address (as the socket reports it) is a loopback one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


class ConnectionCaps:
    """Open HTTP connections and WebSockets per client address (see the module docstring)."""

    def __init__(self, settings: ServerSettings, open_files: int | None = None) -> None:
        files = open_file_limit() if open_files is None else open_files
        self.http_cap = settings.max_connections_per_address
        self.http_cap_loopback = settings.max_connections_per_loopback or min(8192, max(16, files // 2))
        self.total_cap = settings.max_connections or max(32, files * 3 // 4)
        self.socket_cap = settings.max_sockets_per_address
        self.socket_cap_loopback = settings.max_sockets_per_loopback
        self.total = 0
        self.http: dict[str, int] = {}
        self.sockets: dict[str, int] = {}
        self._warned: set[str] = set()  # addresses whose refusals were logged: one line per episode

    def admit_http(self, address: str) -> bool:
        """Count a new HTTP connection of `address`; False (nothing counted) when it is over the cap."""
        loopback = is_loopback_address(address)
        cap = self.http_cap_loopback if loopback else self.http_cap
        held = self.http.get(address, 0)
        if held >= cap:
            setting = "max_connections_per_loopback" if loopback else "max_connections_per_address"
            self._warn(address, f"{held} HTTP connections open from {address}, its cap (server setting {setting}); "
                                "closing more as they come")
            return False
        if self.total >= self.total_cap:
            self._warn("", f"{self.total} HTTP connections open, the server's cap (server setting max_connections, "
                           "by default 3/4 of the open-file limit); closing more as they come")
            return False
        self.http[address] = held + 1
        self.total += 1
        return True

    def release_http(self, address: str) -> None:
        self.total -= 1
        self._release(self.http, address)

    def admit_socket(self, address: str) -> bool:
        """Count a new WebSocket of `address`; False (nothing counted) when it is over the cap."""
        loopback = is_loopback_address(address)
        cap = self.socket_cap_loopback if loopback else self.socket_cap
        held = self.sockets.get(address, 0)
        if held >= cap:
            setting = "max_sockets_per_loopback" if loopback else "max_sockets_per_address"
            self._warn(address, f"{held} WebSockets open from {address}, its cap (server setting {setting}); "
                                "refusing more upgrades with 503")
            return False
        self.sockets[address] = held + 1
        return True

    def release_socket(self, address: str) -> None:
        self._release(self.sockets, address)

    def _release(self, table: dict[str, int], address: str) -> None:
        held = table.get(address, 0) - 1
        if held > 0:
            table[address] = held
        else:
            table.pop(address, None)
            self._warned.discard(address)
        if self.total < self.total_cap:
            self._warned.discard("")

    def _warn(self, address: str, line: str) -> None:
        if address not in self._warned:
            self._warned.add(address)
            logger.warning("%s", line)


def open_file_limit() -> int:
    """This process's open-file limit (the soft one, `ulimit -n`); 1,024 where it cannot be read."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 1024
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raw_error(status: int, error: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """A complete HTTP/1.1 `{"error": …}` response that closes the connection, as bytes."""
    body = json.dumps({"error": error}).encode()
    head = [b"HTTP/1.1 " + _STATUS[status], b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(), b"connection: close",
            *(name + b": " + value for name, value in headers)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def peer_address(transport: Any) -> str:
    """The client address of a connection's transport; "" for a Unix socket."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return ""  # a Unix socket: one address for every local client
