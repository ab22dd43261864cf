"""A fault-injecting TCP proxy on 127.0.0.1, driven from a test (synchronous or async alike).

It runs its own event loop in a thread, so a test can block on a REST call while the proxy keeps
forwarding. Faults, each applied at once to the live connections and to the ones that come next:

    proxy = FaultProxy(server_port).start()
    proxy.cut()                        # RST every live connection; new ones still pass
    proxy.down()                       # also: new connections are accepted and reset at once
    proxy.black_hole()                 # live and new connections: bytes accepted and swallowed, never closed
    proxy.slow(latency=0.2, rate=64_000)  # every chunk delayed, each direction throttled (bytes/s)
    proxy.cut_new_after(300, count=2)  # the next 2 connections are reset after 300 bytes upstream
    proxy.heal()                       # new connections pass normally (black-holed ones stay swallowed)
    proxy.wait_accepted(n)             # an event, not a poll: returns once n connections were accepted

The delays are the injected fault itself; nothing here waits by sleeping for something to happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

CHUNK = 65536
T = TypeVar("T")


@dataclass
class Fault:
    """What the proxy does to a connection's bytes right now (read at every chunk)."""

    black_hole: bool = False
    latency: float = 0.0  # seconds every chunk is held before it is passed on
    rate: float = 0.0  # bytes/s in each direction; 0 = unthrottled


@dataclass(eq=False)
class _Conn:
    fault: Fault
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]
    budget: int | None = None  # bytes client->server before the connection is reset (cut mid-handshake)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def abort(self) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.accepted = 0
        self.forwarded = {"up": 0, "down": 0}  # bytes passed on (not swallowed) in each direction
        self._fault = Fault()
        self._down = False
        self._cut_new: list[int] = []  # byte budgets for the next connections
        self._conns: set[_Conn] = set()
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="faultproxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._closing = self._call(_new_event())
        self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            self._closing.set()
            for conn in list(self._conns):
                conn.abort()
                for task in conn.tasks:
                    task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await self._server.wait_closed()

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _apply(self, change: Callable[[], None]) -> None:
        async def run() -> None:
            change()

        self._call(run())

    # -- faults ----------------------------------------------------------------------------------

    def cut(self) -> None:
        """Reset every live connection (both ends see a dropped link); new ones still pass."""
        def change() -> None:
            for conn in list(self._conns):
                conn.abort()
            self._conns.clear()
        self._apply(change)

    def down(self) -> None:
        """Cut, and reset each new connection as soon as it is accepted, until `heal()`."""
        self._down = True
        self.cut()

    def black_hole(self, *, live: bool = True, new: bool = True) -> None:
        """Swallow bytes without closing: of the live connections and/or of the ones that come next."""
        def change() -> None:
            if live:
                for conn in self._conns:
                    conn.fault.black_hole = True
            if new:
                self._fault = Fault(black_hole=True)
        self._apply(change)

    def slow(self, latency: float = 0.0, rate: float = 0.0) -> None:
        """Delay every chunk by `latency` s and throttle each direction to `rate` bytes/s, live and new."""
        def change() -> None:
            for conn in self._conns:
                conn.fault.latency, conn.fault.rate = latency, rate
            self._fault = Fault(latency=latency, rate=rate)
        self._apply(change)

    def cut_new_after(self, nbytes: int, count: int = 1) -> None:
        """The next `count` connections are reset once `nbytes` went upstream (e.g. mid-registration)."""
        def change() -> None:
            self._cut_new.extend([nbytes] * count)
        self._apply(change)

    def heal(self) -> None:
        """New connections pass untouched again; live black-holed connections stay as they are
        (their peers find out by themselves), slowed ones are sped up."""
        def change() -> None:
            self._down = False
            self._fault = Fault()
            self._cut_new.clear()
            for conn in self._conns:
                conn.fault.latency = conn.fault.rate = 0.0
        self._apply(change)

    def wait_accepted(self, count: int, timeout: float = 30.0) -> None:
        """Block until `count` connections were accepted in all (an event from the proxy's loop)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.accepted >= count, timeout):
                raise AssertionError(f"the proxy accepted {self.accepted} connection(s), not {count}, "
                                     f"within {timeout:g}s")

    # -- forwarding ------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        with self._changed:
            self.accepted += 1
            self._changed.notify_all()
        if self._down:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        budget = self._cut_new.pop(0) if self._cut_new else None
        conn = _Conn(Fault(**vars(self._fault)), (writer, up_writer), budget)
        self._conns.add(conn)
        conn.tasks = [asyncio.ensure_future(self._pipe(conn, reader, up_writer, "up")),
                      asyncio.ensure_future(self._pipe(conn, up_reader, writer, "down"))]
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
            if conn.fault.black_hole:
                # a black hole never tells anyone the link is gone: both ends stay open until the
                # proxy closes (or the peer on that side gives up)
                await self._closing.wait()
        finally:
            self._conns.discard(conn)
            for end in conn.writers:
                end.close()

    async def _pipe(self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    direction: str) -> None:
        """Read, then hand each chunk to a deliverer that holds it for the latency and throttles it:
        chunks in flight overlap, as on a long link (latency does not add up per chunk)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                if conn.fault.black_hole:
                    continue
                if at > loop.time():
                    await asyncio.sleep(at - loop.time())  # the injected latency
                if conn.fault.black_hole:
                    continue
                dst.write(data)
                self.forwarded[direction] += len(data)
                await dst.drain()
                if conn.fault.rate:
                    await asyncio.sleep(len(data) / conn.fault.rate)  # the injected throttle
            if not conn.fault.black_hole:
                with contextlib.suppress(Exception):
                    dst.write_eof()

        deliverer = asyncio.ensure_future(deliver())
        try:
            while True:
                size = 4096 if conn.fault.rate else CHUNK
                data = await src.read(size)
                if not data:
                    break
                if conn.fault.black_hole:
                    continue  # swallowed: the sender sees its bytes taken, the receiver sees nothing
                if direction == "up" and conn.budget is not None:
                    if len(data) >= conn.budget:
                        queue.put_nowait((loop.time(), data[:conn.budget]))
                        await queue.put(None)
                        await deliverer
                        conn.abort()
                        return
                    conn.budget -= len(data)
                queue.put_nowait((loop.time() + conn.fault.latency, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(Exception):
                await deliverer  # cancelled with this task when the proxy closes


async def _new_event() -> asyncio.Event:
    return asyncio.Event()
