"""A real `tether server` process on 127.0.0.1 to attack, with tokens made beforehand and its log kept.

Used by the test_server_*.py attack suites. The server logs at info (the access log included) into
a file the tests read, and its process is the one whose memory they measure.
"""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from tests.kits import db as dbkit
from tests.kits.netutil import Proc, free_port, tether_env, wait_for


@dbkit.keeps_server_state
class Target:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.state = tmp / "state"
        self.state.mkdir()
        db = self.state / "server.db"
        self.api_token, self.device_token = dbkit.create_tokens(dbkit.server_db(db), [
            ("api", "admin", ["read", "execute", "admin"]), ("device", "alpha", [])])
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.aip = f"ws://127.0.0.1:{self.port}/aip"
        self.proc = Proc(["server", "--port", str(self.port), *dbkit.server_db_args(db), "--log-level", "info", *args],
                         tmp / "server.log", tether_env(self.state))
        self.http = httpx.Client(base_url=self.base, timeout=30)
        wait_for(lambda: self.http.get("/api/v1/health").status_code == 200, "server health",
                 procs=(self.proc.popen,))

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_token}"}

    def log(self) -> str:
        return self.proc.output()

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss

    def close(self) -> None:
        self.http.close()
        self.proc.stop()


def connect_raw(port: int, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response (status, headers, body) read from a raw socket; the body by Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a full response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body[:length]


def error_of(body: bytes) -> str:
    """The `error` of a `{"error": …}` body; fails the test for any other shape."""
    data = json.loads(body)
    assert isinstance(data, dict) and set(data) == {"error"} and isinstance(data["error"], str), data
    return data["error"]


def upgrade_request(port: int, path: str = "/aip", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def masked_text_frame_header(length: int) -> bytes:
    """The head of one client text frame of `length` bytes, masked with the all-zero key (payload as is)."""
    if length < 126:
        return bytes([0x81, 0x80 | length]) + b"\0\0\0\0"
    if length < 1 << 16:
        return bytes([0x81, 0x80 | 126]) + length.to_bytes(2, "big") + b"\0\0\0\0"
    return bytes([0x81, 0x80 | 127]) + length.to_bytes(8, "big") + b"\0\0\0\0"


def upgrades_with_big_frames(port: int, count: int, payload: bytes, headers: dict[str, str] | None = None,
                             sample: Callable[[], object] = lambda: None) -> list[int | None]:
    """`count` attackers at once, each asking for the WebSocket upgrade and, as soon as it is granted,
    sending one big text frame, all of it; driven by one select loop that calls `sample()` at every
    turn (e.g. to watch the server's memory while the attack runs).

    An attacker is finished when the server refuses the handshake, closes the connection, or, once
    the whole frame is out, says anything more. Returns the HTTP status each handshake got (None if
    the connection was lost before an answer could be read)."""
    head = upgrade_request(port, headers=headers)
    frame_head = masked_text_frame_header(len(payload))
    socks = [connect_raw(port) for _ in range(count)]
    answers: dict[socket.socket, bytes] = {s: b"" for s in socks}
    granted: set[socket.socket] = set()
    sent = dict.fromkeys(socks, 0)  # bytes of the frame sent (head and payload)
    done: set[socket.socket] = set()
    total = len(frame_head) + len(payload)
    view = memoryview(payload)

    def status(sock: socket.socket) -> int | None:
        if b"\r\n" not in answers[sock]:
            return None
        line = answers[sock].split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) > 1 and line[1].isdigit() else None

    for sock in socks:
        sock.sendall(head)
        sock.setblocking(False)
    try:
        while len(done) < count:
            sample()
            open_socks = [s for s in socks if s not in done]
            writing = [s for s in open_socks if s in granted and sent[s] < total]
            readable, writable, _ = select.select(open_socks, writing, [], 60)
            assert readable or writable, "the server neither read nor answered within 60 s"
            for sock in readable:
                try:
                    chunk = sock.recv(1 << 20)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    chunk = b""
                before, answers[sock] = answers[sock], answers[sock] + chunk
                if not chunk:
                    done.add(sock)
                elif sock not in granted and b"\r\n\r\n" in answers[sock]:
                    if status(sock) == 101:
                        granted.add(sock)
                    else:
                        done.add(sock)
                elif sock in granted and sent[sock] >= total and b"\r\n\r\n" in before:
                    done.add(sock)  # the server's word on the frame
            for sock in writable:
                at = sent[sock]
                data = frame_head[at:] if at < len(frame_head) else view[at - len(frame_head):
                                                                         at - len(frame_head) + (1 << 20)]
                try:
                    sent[sock] += sock.send(data)
                except BlockingIOError:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    done.add(sock)
        sample()
        return [status(s) for s in socks]
    finally:
        for sock in socks:
            sock.close()
