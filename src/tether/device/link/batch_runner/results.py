"""A batch's results and events on their way out: each result into the outbox as soon as it and every one before it
exist (`_deliver`), and the `emit` a running tool sends its events through (`emitter`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from tether.device.link.batch import Batch
from tether.device.link.outbox import Outbox, results_frame
from tether.protocol.messages import ClientMessage, ClientMessageType, Event
from tether.protocol.models import Result


class ResultDelivery:
    """The delivering part of `tether.device.link.batch_runner.BatchRunner`, which sets `outbox` and `client_id`
    in its constructor."""

    outbox: Outbox
    client_id: str | None

    def _deliver(self, batch: Batch, position: int, result: Result) -> None:
        """Fill a slot and put every result that is now next in line into the outbox, in order."""
        if batch.slots[position] is not None:
            return
        batch.slots[position] = result  # an orphaned batch's too: the server records the outcome late
        last = len(batch.slots) - 1
        while batch.sent <= last and batch.slots[batch.sent] is not None:
            ready = batch.slots[batch.sent]
            assert ready is not None
            text = results_frame(batch.msg, ready, last=batch.sent == last, client_id=self.client_id,
                                 max_bytes=self.outbox.max_bytes)
            self.outbox.put_result(text, ready.call_id)
            batch.sent += 1

    def emitter(self, batch: Batch) -> Callable[[str, dict[str, Any]], None]:
        """The sync `emit` tools call: it only enqueues, never blocks the tool. Called from another
        thread (a tool's worker thread), it hands the event to the loop instead of touching the queue."""
        response_id = batch.msg.response_id
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()

        def emit(kind: str, data: dict[str, Any]) -> None:
            call_id = data.get("call_id") if isinstance(data, dict) else None
            message = ClientMessage(type=ClientMessageType.EVENT, client_id=self.client_id, payload=Event(
                kind=kind, response_id=response_id, call_id=call_id, data=data).model_dump())
            if threading.get_ident() == loop_thread:
                self.outbox.put_event(message)
            else:
                loop.call_soon_threadsafe(self.outbox.put_event, message)

        return emit
