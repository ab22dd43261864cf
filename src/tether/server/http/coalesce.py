"""One socket write per event-loop turn and connection: the HTTP protocol uvicorn runs, with its transport
wrapped so that what a response writes in one turn leaves in one `send` syscall.

uvicorn writes an HTTP response's status line and headers when the app sends `http.response.start`
and the body when it sends `http.response.body`: two syscalls for a response the app sends whole, and
on loopback each write also wakes the reader. `bench/fleet_hotpath.py` with py-spy put those two
writes at ~22% of the server's CPU per command (the device's frame the third write, ~11%). With the
writes of one turn joined, a response sent whole is one write (`routes.commands.BatchResponse` sends its start
and its body in the same turn when the batch ends quickly).

The joined bytes leave at the end of the turn (`loop.call_soon`), before any I/O is polled again, in
the order written; `close`, `write_eof`, `set_protocol` (the WebSocket upgrade) and `abort` see to
what is pending first. Everything else is the real transport's, and after a WebSocket upgrade the
WebSocket protocol writes to the real transport directly (`set_protocol`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tether.server.http import internals

# The scope key under which the coalescing protocol offers `watch(callback) -> unwatch`: `callback` runs once
# when the request's connection is lost (at once, on the next turn, if it already is). A response that
# waits (routes.commands.BatchResponse) learns of a caller gone without a task per request reading `receive` for the
# `http.disconnect` — that task was ~4% of the server's CPU per REST command. Other ASGI servers do not set
# it; the response then falls back to the task.
ON_DISCONNECT = "tether.on_disconnect"


class CoalescingTransport:
    """An `asyncio.Transport` whose writes in one loop turn go out as one."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [bytes(data)]
            self._loop.call_soon(self.flush)
        else:
            self._pending.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """The WebSocket upgrade: what is pending leaves first, and the WebSocket protocol gets the real
        transport. A socket's frames are written one at a time as they are sent, so there is nothing to
        join, and the deferred flush per frame (a loop callback and this wrapper's calls) was ~4% of the
        server's CPU per device in a 4,000-device fan-out (py-spy)."""
        self.flush()
        self._transport.set_protocol(protocol)
        internals.give_websocket_real_transport(protocol, self, self._transport)

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:  # pause_reading, resume_reading, get_write_buffer_size, …
        return getattr(self._transport, name)


def coalescing_http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools' when installed, else h11's, as `http="auto"` picks), with
    its transport wrapped in a `CoalescingTransport` as the connection is made and `ON_DISCONNECT` in every
    request's scope (`internals.coalescing_http_protocol`)."""
    return internals.coalescing_http_protocol(
        ON_DISCONNECT, lambda transport: CoalescingTransport(transport, asyncio.get_running_loop()))
