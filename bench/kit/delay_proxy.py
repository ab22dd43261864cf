"""A TCP proxy on 127.0.0.1 that delays every byte by a fixed time in each direction: a database "2 ms away".

`DelayProxy(target_port, delay_s)` listens on a free port (`port`) once `start()` returns and forwards every
connection to `target_port`, each chunk written `delay_s` after it was read, in order (a link's latency, not
its bandwidth). It runs its own event loop on a thread of its own, so the process measured is not the one
doing the delaying; `close()` stops it and closes every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class DelayProxy:
    """See the module docstring."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def start(self) -> DelayProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(30)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while chunk := await reader.read(65536):
                if self.delay_s <= 0:
                    writer.write(chunk)
                else:  # call_at keeps the order of equal deadlines: the bytes leave as they came
                    loop.call_at(loop.time() + self.delay_s, _write, writer, chunk)
        finally:
            if self.delay_s > 0:
                loop.call_at(loop.time() + self.delay_s, writer.close)
            else:
                writer.close()

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for writer in self._writers:
                writer.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _write(writer: asyncio.StreamWriter, chunk: bytes) -> None:
    if not writer.is_closing():
        writer.write(chunk)
