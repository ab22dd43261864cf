"""A plain HTTP server on this machine's loopback answering every GET with one fixed body: the "outside"
host the egress tests reach (threads: the processes under test are others)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _handler(body: bytes) -> type[BaseHTTPRequestHandler]:
    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    return Answer


def start_upstream(body: bytes) -> ThreadingHTTPServer:
    """A server on 127.0.0.1 (a free port: `server_address[1]`) answering every GET with `body`, served from a
    daemon thread; the caller ends it with `shutdown()` and `server_close()`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(body))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@contextmanager
def upstream(body: bytes) -> Iterator[int]:
    """`start_upstream(body)` for the block; its port."""
    server = start_upstream(body)
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
