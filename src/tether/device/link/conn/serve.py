"""A registered link's life: the reader, the sender that drains the outbox, and the heartbeat that also
notices a silent server, run side by side until one of them ends or the connection is stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from websockets.asyncio.client import ClientConnection
from websockets.protocol import State

from tether.device.link import settings as link_settings
from tether.device.link.batch_runner import BatchRunner
from tether.device.link.keepalive import beat_due
from tether.device.link.outbox import Outbox
from tether.device.link.reconnect import describe_failure
from tether.device.link.settings import ConnectionState
from tether.errors import DeviceError
from tether.protocol.codec import HeartbeatFrame
from tether.protocol.device_session import DeviceSession
from tether.protocol.messages import RegisterAck

# the link's records keep the one logger name operators filter on (`tether.device.link.connection`)
logger = logging.getLogger("tether.device.link.connection")


class _LinkDead(DeviceError, ConnectionError):
    pass



class Serving:
    """`DeviceConnection`'s registered link: reader, sender and heartbeat, and the goodbye."""

    name: str | None
    outbox: Outbox
    batches: BatchRunner
    connected: asyncio.Event
    last_error: str | None
    _stop: asyncio.Event
    _last_rx: float
    _grace_until: float | None
    _side_tasks: set[asyncio.Task[None]]
    _profile_version: int
    _registered_version: int
    _heartbeat_frame: HeartbeatFrame

    if TYPE_CHECKING:
        @property
        def url(self) -> str: ...

        def _set_state(self, state: ConnectionState) -> None: ...

        def _push_profile(self) -> None: ...

        async def _reader(self, ws: ClientConnection, session: DeviceSession, hand_over: Callable[[], None]) -> None:
            ...

    async def _serve(self, ws: ClientConnection, session: DeviceSession, ack: RegisterAck) -> float:
        loop = asyncio.get_running_loop()
        started = self._last_rx = loop.time()
        keepalive = getattr(ws, "keepalive_task", None)
        if max(ack.heartbeat_timeout, ack.heartbeat_interval) <= 2 * link_settings.KEEPALIVE_S \
                and keepalive is not None:
            # the heartbeat notices a silent server before the socket's keepalive could (a ping every
            # KEEPALIVE_S, a pong awaited as long): its pings would only cost both sides a frame and a timer
            keepalive.cancel()
        self.outbox.open(ack.max_frame_bytes)
        self.connected.set()
        self._set_state("registered")
        if self._profile_version != self._registered_version:  # a server joined while we registered
            self._push_profile()
        stopper = asyncio.create_task(self._stop.wait())
        # The socket's reader may hand the socket over to a new reader and become a batch's task (see
        # `_reader`): `reading` ends when the reader of the moment ends, however it ends.
        reading: asyncio.Future[None] = loop.create_future()
        readers: set[asyncio.Task[None]] = set()

        def reader_done(task: asyncio.Task[None]) -> None:
            if task not in readers or reading.done():  # one that handed over: a batch's task now
                return
            readers.discard(task)
            if task.cancelled():
                reading.cancel()
            elif task.exception() is not None:
                reading.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                reading.set_result(None)

        def start_reader() -> None:
            task = asyncio.create_task(self._reader(ws, session, hand_over))
            readers.add(task)
            task.add_done_callback(reader_done)

        def hand_over() -> None:
            readers.discard(asyncio.current_task())
            start_reader()

        start_reader()
        tasks: set[asyncio.Future[Any]] = {reading, asyncio.create_task(self._sender(ws)),
                                           asyncio.create_task(self._heartbeat(ws, ack)), stopper}
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if stopper in done:  # say goodbye properly: failures of cancelled batches first
                await self.batches.abort_all()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2.0):
                        await self.outbox.idle.wait()
                self.last_error = None
            else:
                failed = [exc for t in done if (exc := t.exception()) is not None]
                self.last_error = (describe_failure(failed[0]) if failed else
                                   f"the server closed the connection ({ws.close_code}"
                                   f"{': ' + ws.close_reason if ws.close_reason else ''})")
                logger.warning("connection to %s lost: %s", self.url, self.last_error)
        finally:
            # from now on the server keeps our batches for its grace period (it may have noticed the loss
            # a little later than we did, never much earlier: heartbeats bound both sides alike)
            self._grace_until = loop.time() + ack.grace_period
            self.connected.clear()
            self.outbox.close()
            for task in (*tasks, *readers, *self._side_tasks):
                task.cancel()
            await asyncio.gather(*tasks, *readers, *self._side_tasks, return_exceptions=True)
            session.closed(ws.close_code)
            if ws.transport is not None and not ws.transport.is_closing() and self.last_error:
                ws.transport.abort()  # a dead link would only make the closing handshake wait
        return loop.time() - started

    async def _sender(self, ws: ClientConnection) -> None:
        outbox = self.outbox

        def write_now(text: str) -> bool:
            # what `ws.send` does for a text frame when nothing is buffered, without the await; a
            # socket that is closing or has a backlog is left to the sender
            if ws.state is not State.OPEN or ws.transport.get_write_buffer_size():
                return False
            ws.protocol.send_text(text.encode())
            ws.send_data()
            return True

        while True:
            frame = outbox.pop()
            if frame is None:
                outbox.wait_state()
                outbox.write_now = write_now
                try:
                    await outbox.ready.wait()
                finally:
                    outbox.write_now = None
                continue
            try:
                await ws.send(frame[1])
                outbox.written(frame)  # a result is kept until the server acknowledges it (Outbox)
            except BaseException:
                # The frame may or may not have left: a result stays owed (at least once; the server
                # ignores a second result for a call it already has), an event is let go.
                outbox.push_back(frame)
                raise

    async def _heartbeat(self, ws: ClientConnection, ack: RegisterAck) -> None:
        """Send heartbeats every `heartbeat_interval`; no frame at all for `heartbeat_timeout` means
        the link is dead even if TCP has not noticed (a silent server, a vanished NAT entry).

        A beat is skipped when frames went both ways since the last one and the load it would report
        is what the last beat said (`keepalive.beat_due`)."""
        loop = asyncio.get_running_loop()
        interval = max(ack.heartbeat_interval, 0.01)  # a careless ACK must not make this spin
        timeout = max(ack.heartbeat_timeout, interval)
        if self._heartbeat_frame.client_id != self.name:  # renamed since: the template follows
            self._heartbeat_frame = HeartbeatFrame(self.name)
        beat, batches, outbox = self._heartbeat_frame, self.batches, self.outbox
        next_beat = loop.time() + interval  # the outbox goes first after registering
        said: tuple[int, int] | None = None  # (running, queued) as the last beat told them
        puts = outbox.puts
        while True:
            now = loop.time()
            if now - self._last_rx > timeout:
                raise _LinkDead(f"nothing from the server for {now - self._last_rx:.1f}s "
                                f"(heartbeat timeout {timeout:g}s)")
            if now >= next_beat:
                news = (batches.running, batches.queued)
                # results waiting for the acknowledgement only a beat's answer brings: as if nothing was sent
                if beat_due(outbox.puts != puts and not outbox.unacked, now - self._last_rx, interval, news, said):
                    outbox.put_heartbeat(beat(*news))
                    said = news
                puts = outbox.puts
                next_beat = now + interval
            # asleep until the next beat or the moment the silence would pass the timeout, whichever is
            # first (a frame arriving meanwhile moves that moment on: checked again on waking)
            wake = min(next_beat, self._last_rx + timeout)
            await asyncio.sleep(max(wake - now, 0.0) + 0.001)
