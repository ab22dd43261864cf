"""`BatchRouter`: where each command batch goes — to its device's socket here, into the queue of a device
within its grace period, or to the node of a cluster that holds the device — and how it is cancelled.

The router keeps the ledger of batches in flight (`BatchBook`); the hub keeps the connections (the
table of `DeviceLink`s it reads) and the grace periods, and calls `flush` after a (re)registration.
A dispatcher sends through it (`ports.BatchSender`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from tether.protocol.messages import Event, ServerMessage, ServerMessageType, TaskStatus
from tether.server.aip.batches.ledger import BatchBook, PendingBatch, TokenRef
from tether.server.aip.desktop_holds import DesktopHolds
from tether.server.aip.fleet.liveness import GracePeriods
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.sockets.link import DeviceLink
from tether.server.ports import BackplaneUnavailable, BatchAudit, RemoteDevices, RemoteSlot


class BatchRouter:
    """The batches in flight and their way to a device.

    `links` is the hub's table of connections (device name → its link, only read here); `grace` the
    devices within their grace period (one that moved to another node leaves it here); `registry`
    names known devices in errors; `audit` (the store's audit table) records outcomes that come after
    their caller stopped waiting (`record_late`); `tasks` is the hub's set of background tasks, awaited
    when it closes.
    `remote` is the cluster (None on one server), and `close()` makes every later batch fail as the
    server shutting down."""

    def __init__(self, links: Mapping[str, DeviceLink], grace: GracePeriods, registry: DeviceRegistry,
                 audit: BatchAudit, tasks: set[asyncio.Task[Any]], remote: RemoteSlot) -> None:
        self._links = links
        self._grace = grace
        self._registry = registry
        self._audit = audit
        self._tasks = tasks
        self.book = BatchBook(registry, self.record_late)
        self._remote = remote
        self.closed = False
        self.desktop = DesktopHolds()  # persons' holds on devices' desktops, and the live views watching

    @property
    def remote(self) -> RemoteDevices | None:
        """The cluster's other nodes while this node's `ClusterNode` runs, else None."""
        return self._remote.remote

    def close(self) -> None:
        """From now on a batch is not sent: it fails saying the server is shutting down."""
        self.closed = True

    def pending(self, response_id: str) -> PendingBatch | None:
        """The batch in flight with this id, or None."""
        return self.book.pending.get(response_id)

    async def send_batch(self, device: str, message: ServerMessage, *,
                         on_event: Callable[[Event], None] | None = None, here_only: bool = False,
                         asker: TokenRef | None = None) -> PendingBatch:
        """Register a COMMAND batch and send it, or queue it while `device` is within its grace period,
        or (in a cluster, unless `here_only`) hand it to the node that holds the device.

        Returns a batch already `done` (with `error`) when the device is offline or unknown. `asker` is
        the API token whose command it is (`PendingBatch.asker`).
        """
        call_ids = [c.call_id for c in message.actions or [] if c.call_id]
        batch = PendingBatch(message.response_id, device, message, on_event, asker=asker, outstanding=set(call_ids))
        conn = self._links.get(device)
        if self.closed:
            batch.error = "the server is shutting down"
        elif (held := self.desktop.refusal(device, [c.tool_name for c in message.actions or []], asker)) is not None:
            batch.error = held
            self.desktop.observe(batch, self._tasks)  # the live view shows the refused attempt too
        elif message.response_id in self.book.pending:
            batch.error = f"response_id {message.response_id} is already in use"
        elif conn is None and device not in self._grace:
            if self.remote is not None and not here_only and await self._send_remote(batch):
                return batch
            batch.error = (f"device {device} is offline" if self._registry.get(device)
                           else f"no device named {device} has registered")
        if batch.error is not None:
            batch.done.set()
            return batch
        self.book.open(batch)
        self.desktop.observe(batch, self._tasks)
        if conn is not None and conn.ready:
            await self._send_command(conn, batch)
        return batch

    async def _send_remote(self, batch: PendingBatch) -> bool:
        """Hand `batch` to the node holding its device; False when no node does (it is offline)."""
        assert self.remote is not None
        try:
            holder = await self.remote.holder(batch.device)
        except BackplaneUnavailable as exc:
            batch.error = f"not sent: {exc}"
            batch.done.set()
            return True
        if holder is None or holder == self.remote.node or self.closed:
            return False
        self.route(batch, holder)
        return True

    def route(self, batch: PendingBatch, holder: str) -> None:
        """Let the node `holder` run `batch` (it holds the device's socket); the batch finishes here."""
        assert self.remote is not None
        if batch.response_id not in self.book.pending:
            self.book.open(batch)
        batch.sent = True
        batch.remote = asyncio.create_task(self.remote.run_batch(batch, holder), name=f"remote-{batch.response_id}")
        self._tasks.add(batch.remote)
        batch.remote.add_done_callback(self._tasks.discard)

    async def adopt(self, batch: PendingBatch) -> None:
        """A batch another node was running came back with its device, now connected here: send it (the
        same ids, so the device answers a call it already ran from its record instead of running it)."""
        batch.remote = None
        batch.sent = False
        conn = self._links.get(batch.device)
        if batch.done.is_set() or batch.response_id not in self.book.pending:
            return
        if conn is not None:
            if conn.ready:  # else it is registering: `_flush` sends it right after the REGISTER_ACK
                await self._send_command(conn, batch)
        elif batch.device not in self._grace:
            self.book.finish(batch, f"device {batch.device} is offline")

    def moved(self, device: str, holder: str) -> None:
        """Another node took `device`'s socket: what this node sent it and still waits for goes there
        (with the same ids) instead of waiting out the grace period for a socket that will not return."""
        if self.remote is None or device in self._links:
            return
        self._grace.stop(device)
        self.book.forget_cancels(device)
        for batch in self.book.of_device(device):
            if batch.origin is not None:  # run here for another node: that node sends it on itself
                self.book.finish(batch, f"not held here: device {device} moved to node {holder}")
            elif batch.remote is None:
                self.route(batch, holder)

    def finish_remote(self, batch: PendingBatch, results: list[Any], error: str | None, *,
                      pending: bool = False) -> None:
        """The holding node's answer for `batch`: its results, then `error` for any call without one
        (with `pending`: its outcome may still come, e.g. the backplane cannot be reached)."""
        for result in results:
            if result.call_id in batch.outstanding:
                batch.outstanding.discard(result.call_id)
                batch.results[result.call_id] = result
        self.book.finish(batch, error, pending=pending)

    def record_late(self, device: str, response_id: str, results: list[Any],
                    then: Callable[[int], None] | None = None) -> int | None:
        """Record results `device` sent for a batch no caller waits on any more (`BatchAudit.late`): the
        outcome is a fact whenever it comes; only rows sent to that device with an open outcome change. How
        many, also given to `then`; None when the write was handed off the event loop (`then` tells later)."""
        return self._audit.late(device, [(response_id, r.call_id, r.status.value, r.error)
                                         for r in results if r.call_id], then)

    def batch_device(self, response_id: str) -> str | None:
        """The device of a batch in flight started or held here, or None (a scoped token's cancel is checked)."""
        batch = self.book.pending.get(response_id)
        return batch.device if batch is not None else None

    async def cancel(self, response_id: str, reason: str = "cancelled", *, pending: bool = False) -> bool:
        """Finish the batch with `reason` for its unfinished commands and tell the device to stop it;
        with `pending` (a timeout) its unfinished commands end "outcome pending" — what the device answers
        to the CANCEL, or had already finished, is recorded when it comes (`record_late`).

        A device that is away gets the CANCEL when it comes back (same process, within grace)."""
        batch = self.book.pending.get(response_id)
        if batch is None:
            return False
        routed = batch.remote is not None
        self.book.finish(batch, reason, pending=pending)  # another node runs it: stopped there too
        if batch.sent and not routed:
            conn = self._links.get(batch.device)
            frame = ServerMessage(type=ServerMessageType.CANCEL, response_id=response_id, status=TaskStatus.OK)
            if conn is None or not conn.ready or not await conn.send(frame):
                self.book.queue_cancel(batch.device, response_id)
        return True

    async def _send_command(self, conn: DeviceLink, batch: PendingBatch) -> None:
        batch.sent = True  # before the await, so a concurrent flush does not send it twice
        if not await conn.send(batch.message):
            batch.sent = False  # it goes out again after the reconnection

    async def flush(self, conn: DeviceLink, *, resend: bool = False) -> None:
        """After a (re)registration: send the batches queued while the device was away, then CANCELs.

        With `resend` (the same device process came back) batches already sent go out again too: a
        result written into a link that was already dead is lost, and the device answers a call of a
        batch it already ran (the same response_id, which only this server issues, and call_id) from
        its record of finished calls without running it twice (at-least-once delivery, exactly-once
        execution)."""
        for batch in self.book.to_send(conn.name, resend=resend):
            if not batch.done.is_set():
                await self._send_command(conn, batch)
        for response_id in self.book.take_cancels(conn.name):
            await conn.send(ServerMessage(type=ServerMessageType.CANCEL, response_id=response_id, status=TaskStatus.OK))
