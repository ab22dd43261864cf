"""The egress proxy's data path: bytes moved between two TCP sockets by splice(2), never copied into Python.

Each direction has a pipe: the kernel moves a socket's pages into it and from it into the other
socket, so a tunnel costs a few system calls per chunk instead of two copies of every byte. The
event loop drives it (readers and writers on the sockets, no thread): a direction reads only when its
pipe is empty, and when the other socket cannot take more it waits for that socket to be writable —
memory stays bounded by the pipes. Standard library only (Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Callable

F_SETPIPE_SZ = 1031
SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH)


class _Direction:
    """Bytes from `src` to `dst` through one pipe; `count` is told how many moved."""

    def __init__(self, relay: Relay, src: socket.socket, dst: socket.socket, count: Callable[[int], None],
                 chunk: int, splice: bool) -> None:
        self.relay, self.src, self.dst, self.count = relay, src, dst, count
        self.read_end = self.write_end = -1
        self.buffer: memoryview | None = None
        if splice:
            self.read_end, self.write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            with contextlib.suppress(OSError):  # a bigger pipe where allowed: fewer wake-ups per megabyte
                fcntl.fcntl(self.write_end, F_SETPIPE_SZ, chunk)
        else:
            self.buffer = memoryview(bytearray(chunk))
        self.chunk = chunk
        self.start_at = 0  # copying: where the unsent bytes start in the buffer
        self.pending = 0  # bytes in the pipe (or buffer), not yet in dst
        self.eof = False
        self.done = False

    def start(self) -> None:
        self.relay.loop.add_reader(self.src.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            if self.buffer is None:
                moved = os.splice(self.src.fileno(), self.write_end, self.chunk, flags=SPLICE_FLAGS)
            else:
                moved = self.src.recv_into(self.buffer)
                self.start_at = 0
        except BlockingIOError:
            return
        except OSError as exc:
            self.relay.fail(exc)
            return
        if moved == 0:
            self.eof = True
            self.relay.loop.remove_reader(self.src.fileno())
            self._finish()
            return
        self.pending += moved
        self.count(moved)
        self.relay.touch()
        self._flush()

    def _flush(self) -> None:
        while self.pending:
            try:
                if self.buffer is None:
                    sent = os.splice(self.read_end, self.dst.fileno(), self.pending, flags=SPLICE_FLAGS)
                else:
                    sent = self.dst.send(self.buffer[self.start_at:self.start_at + self.pending])
                    self.start_at += sent
            except BlockingIOError:
                # dst is full: stop reading src until it drains
                self.relay.loop.remove_reader(self.src.fileno())
                self.relay.loop.add_writer(self.dst.fileno(), self._writable)
                return
            except OSError as exc:
                self.relay.fail(exc)
                return
            self.pending -= sent

    def _writable(self) -> None:
        self._flush()
        if self.pending == 0 and not self.done:
            self.relay.loop.remove_writer(self.dst.fileno())
            if self.eof:
                self._finish()
            else:
                self.relay.loop.add_reader(self.src.fileno(), self._readable)

    def _finish(self) -> None:
        """src ended: once the pipe is empty, end dst's writing side (a half-close, as the client did)."""
        if self.pending:
            return  # _writable finishes when drained
        self.done = True
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)
        self.relay.direction_done()

    def close(self) -> None:
        loop = self.relay.loop
        for fd in (self.src.fileno(), self.dst.fileno()):
            if fd >= 0:
                loop.remove_reader(fd)
                loop.remove_writer(fd)
        for fd in (self.read_end, self.write_end):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.buffer is not None:
            self.buffer.release()


class Relay:
    """Joins `client` and `upstream` (connected, non-blocking TCP sockets) until both directions have ended,
    either side fails, or no byte moved for `idle_timeout_s`. `up(n)` / `down(n)` count the bytes.

    `splice=False` copies through one buffer per direction instead (recv_into / send), for comparison
    and for sockets splice(2) does not take."""

    def __init__(self, client: socket.socket, upstream: socket.socket, *, up: Callable[[int], None],
                 down: Callable[[int], None], idle_timeout_s: float, chunk: int, splice: bool = True) -> None:
        self.loop = asyncio.get_running_loop()
        self.idle_timeout_s = idle_timeout_s
        self.last = self.loop.time()
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self.error: OSError | None = None
        self._ended = 0
        self._timer: asyncio.TimerHandle | None = None
        self._directions = (_Direction(self, client, upstream, up, chunk, splice),
                            _Direction(self, upstream, client, down, chunk, splice))

    def touch(self) -> None:
        self.last = self.loop.time()

    def fail(self, exc: OSError) -> None:
        if exc.errno not in _GONE:
            self.error = exc
        self._end()

    def direction_done(self) -> None:
        self._ended += 1
        if self._ended == 2:
            self._end()

    def _check_idle(self) -> None:
        idle = self.loop.time() - self.last
        if idle >= self.idle_timeout_s:
            self._end()
        else:
            self._timer = self.loop.call_later(self.idle_timeout_s - idle, self._check_idle)

    def _end(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)

    async def run(self) -> None:
        """Relay until the end; the sockets stay open (the caller closes them), the pipes are closed."""
        try:
            for direction in self._directions:
                direction.start()
            self._timer = self.loop.call_later(self.idle_timeout_s, self._check_idle)
            await self.finished
        finally:
            if self._timer is not None:
                self._timer.cancel()
            for direction in self._directions:
                direction.close()
