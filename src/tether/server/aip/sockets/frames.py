"""`DeviceHub`'s reader of a registered device's frames and what each one (as `ServerSession` judges it)
asks the hub to do."""

from __future__ import annotations

import asyncio
import logging
import time

from tether.protocol.server_session import (
    BadFrame,
    DeviceReportedError,
    EventArrived,
    HeartbeatArrived,
    OutcomesReported,
    PolicyReported,
    ProfileReported,
    ResultsArrived,
    SamplingRequested,
    SessionEvent,
)
from tether.server.aip.hub_state import HubState
from tether.server.aip.questions.asked import answer_sampling
from tether.server.aip.sockets.link import DeviceLink
from tether.server.aip.sockets.socket import SocketClosed

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name


class HubFrames(HubState):
    """The receive loop of one device connection and the handling of each frame."""

    async def _receive_loop(self, conn: DeviceLink) -> None:
        """Read `conn`'s frames until it closes or is dropped; its session says what each one means."""
        session = conn.session
        assert session is not None  # set when the registration was accepted
        while not conn.dropped:
            try:
                frame = await conn.socket.receive_text()
            except SocketClosed:
                return
            if conn.dropped:
                return
            conn.last_seen = time.monotonic()
            conn.record.last_seen = time.time()
            try:
                event = session.receive(frame)
                await self._handle(conn, event)
            except Exception:
                kind = session.last_type.value if session.last_type is not None else "unreadable"
                logger.exception("error handling a %s frame from device %s", kind, conn.name)
                await conn.error(f"the server failed to handle this {kind} frame", "internal")
            del frame, event  # not kept while the socket idles until its next frame (~1 KiB per device)

    async def _handle(self, conn: DeviceLink, event: SessionEvent) -> None:
        """Act on what one frame of `conn` meant (`ServerSession.receive`)."""
        if isinstance(event, ResultsArrived):
            self._batches.accept(conn.name, event.message)
        elif isinstance(event, HeartbeatArrived):
            if event.load is not None and event.load != (conn.record.running, conn.record.queued):
                conn.record.running, conn.record.queued = event.load
                self.registry.notify()
            await conn.heartbeat()
        elif isinstance(event, BadFrame):
            if event.frame_error:
                logger.warning("bad frame from device %s: %s", conn.name, event.error)
            await conn.error(event.error, event.reason)
        elif isinstance(event, EventArrived):
            batch = self._batches.pending.get(event.event.response_id or "")
            if batch is None or batch.device != conn.name or not batch.sent:
                logger.debug("dropped event %s from device %s for batch %s", event.event.kind, conn.name,
                             event.event.response_id)
                return
            self.deliver_event(batch, event.event)
        elif isinstance(event, PolicyReported | OutcomesReported):
            msg = event.message
            device, answer = self._replies.get(msg.prev_response_id or "", (None, None))
            if answer is None or device != conn.name or answer.done():
                logger.info("dropped a %s from device %s: nothing asked for it", msg.type.value, conn.name)
            else:
                answer.set_result(msg)
        elif isinstance(event, ProfileReported):
            conn.record.profile = event.profile
            assert conn.record.last_seen is not None  # set when it registered
            self._remember(conn.name, conn.record, conn.record.last_seen)
            self.registry.notify()
            self._fleet_changed(conn.name)
        elif isinstance(event, SamplingRequested):
            call_id = str((event.message.payload or {}).get("call_id") or "")
            batch = self._batches.running_call(conn.name, call_id)  # the command it says it serves, if running
            refusal = self._sampling.admit(conn.name, call_id, batch)
            job = asyncio.create_task(answer_sampling(self.sampler, conn, event.message, refusal=refusal,
                                                      caller=batch.asker if batch is not None else None,
                                                      audit=self.store.audit))
            self._tasks.add(job)
            job.add_done_callback(self._tasks.discard)
        elif isinstance(event, DeviceReportedError):
            msg = event.message
            batch = self._batches.pending.get(msg.prev_response_id or "")
            logger.warning("device %s reported an error%s: %s", conn.name,
                           f" for batch {msg.prev_response_id}" if msg.prev_response_id else "", msg.error)
            if batch is not None and batch.device == conn.name and batch.sent:
                self._batches.finish(batch, f"device {conn.name} reported: {msg.error or 'an error'}")
        else:  # REGISTER again
            await conn.error(event.error, "unexpected")
