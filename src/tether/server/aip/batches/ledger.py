"""`PendingBatch` and `BatchBook`: the server's ledger of COMMAND batches in flight.

Which device owes which `call_id`, what came back, which batches ended (so a late result is
logged as late, not as forged) and which CANCELs wait for a device that is away: these rules
decide what a caller finally gets, and they hold whatever the sockets do. Keeping them apart from
the hub's connection handling lets them be read, and reasoned about, without any I/O: the book
never sends a frame; the hub asks it what to send.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether.protocol.messages import ClientMessage, Event, ServerMessage, TaskStatus
from tether.protocol.models import Result
from tether.server.aip.fleet.registry import DeviceRegistry

logger = logging.getLogger("tether.server.hub")  # the hub's log: operators (and tests) filter on that name

_FINISHED_MEMORY = 4096  # finished batches remembered so their late results are logged as late
_LATE_MISSES = 1000  # late results in a row that settle nothing before a device's are no longer looked up


@dataclass(frozen=True, slots=True)
class TokenRef:
    """An API token as a batch's caller or a question's answerer: its name and whether it is an agent's
    (an agent's token never answers a question meant for a person; docs/security/approvals.md)."""

    name: str
    agent: bool = False
    sample: bool = False  # it holds the `sample` scope: its commands' MCP servers may use the server's LLM
    # the key of a person's hold on the device's desktop (server/aip/desktop_holds.py): set only on the
    # batches the live view sends for the person holding it; in a cluster it travels to the node holding
    # the device, which holds the desktop and checks the key (nodes trust each other's bus)
    hold: str | None = None

    @classmethod
    def of(cls, token: Any) -> TokenRef:
        """The reference to an authenticated token (a `TokenInfo`: its name, `agent`, `allows(scope)`)."""
        return cls(token.name, bool(token.agent), bool(token.allows("sample")))

    def to_dict(self) -> dict[str, Any]:
        """The form it travels in between the nodes of a cluster."""
        return {"name": self.name, "agent": self.agent, "sample": self.sample,
                **({"hold": self.hold} if self.hold is not None else {})}

    @classmethod
    def from_dict(cls, data: Any) -> TokenRef | None:
        """The token `to_dict` wrote, or None when `data` names none (a peer that sent no caller)."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            return None
        hold = data.get("hold")
        return cls(data["name"][:128], bool(data.get("agent", False)), data.get("sample") is True,
                   hold[:64] if isinstance(hold, str) and hold else None)


@dataclass(eq=False)
class PendingBatch:
    """A batch the hub waits on. `done` is set once: all results in, or `error` says why not."""

    response_id: str
    device: str
    message: ServerMessage
    on_event: Callable[[Event], None] | None = None
    # the API token whose command this is (None: an internal batch, or a task's, whose route decides): the
    # questions its external MCP servers ask are this caller's to answer (DeviceHub.answer_question)
    asker: TokenRef | None = None
    results: dict[str, Result] = field(default_factory=dict)
    outstanding: set[str] = field(default_factory=set)
    error: str | None = None
    sent: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # set while another node of the cluster runs it (server/ports.py): finishing the batch here stops that
    remote: asyncio.Task[None] | None = None
    origin: str | None = None  # the node this one runs it for (its caller, timeout and audit are there)
    # the calls without a result may still be running (the wait ended: timeout, link lost, grace over):
    # their callers are told "outcome pending", and a result that comes later is recorded (BatchBook.on_late)
    pending: bool = False


class BatchBook:
    """The batches in flight by `response_id`, and each device's in-flight count in the registry."""

    def __init__(self, registry: DeviceRegistry,
                 on_late: Callable[[str, str, list[Result], Callable[[int], None]], object] | None = None) -> None:
        self.registry = registry
        # records results that come after their batch ended (device, response_id, results, then): `then(rows
        # settled)` once written (at once, or later when the write is handed off the event loop)
        self.on_late = on_late
        # per device, late results in a row that matched no open row: past _LATE_MISSES they are not looked
        # up any more (each lookup is a write transaction; a device must not make the server spin on them)
        self._late_misses: dict[str, int] = {}
        self._late_asking: dict[str, int] = {}  # per device, late lookups not answered yet
        self.pending: dict[str, PendingBatch] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()  # response_id -> device
        self._cancels: dict[str, list[str]] = {}  # CANCELs waiting for a disconnected device

    def open(self, batch: PendingBatch) -> None:
        self.pending[batch.response_id] = batch
        self.registry.ensure(batch.device).inflight += 1
        self.registry.notify()

    def accept(self, device: str, msg: ClientMessage) -> None:
        """Take the results of a COMMAND_RESULTS frame from `device`: only for a batch sent to it, only
        for call_ids still outstanding."""
        rid = msg.prev_response_id or ""
        batch = self.pending.get(rid)
        results = msg.action_results or []
        if batch is None or batch.device != device or not batch.sent:
            self._late(device, rid, results, finished_here=self._finished.get(rid) == device)
            return
        for result in results:
            if result.call_id in batch.outstanding:
                batch.outstanding.discard(result.call_id)
                batch.results[result.call_id] = result
            else:
                logger.warning("ignored result from device %s for call_id %s of batch %s: not outstanding",
                               device, result.call_id, rid)
        if not batch.outstanding:
            self.finish(batch)
        elif msg.status in (TaskStatus.FAILED, TaskStatus.ERROR):
            self.finish(batch, f"device {device} failed the batch: {msg.error or 'no reason given'}")
        elif msg.status is TaskStatus.COMPLETED:
            self.finish(batch, f"device {device} completed the batch without a result for this command")

    def _late(self, device: str, rid: str, results: list[Result], *, finished_here: bool) -> None:
        """Results for a batch no caller waits on any more: recorded where its rows say they were sent
        to this device and their outcome is still open (`AuditLog.late`), else refused."""
        misses = self._late_misses.get(device, 0)
        # lookups still on their way (written off the loop with PostgreSQL) count as misses until they answer:
        # a flood of results for nothing is looked up _LATE_MISSES times at most, however fast it comes
        asking = self._late_asking.get(device, 0)
        if self.on_late is None or not rid or not results or misses + asking >= _LATE_MISSES:
            self._told_late(device, rid, results, 0, finished_here=finished_here, looked_up=False)
            return
        self._late_asking[device] = asking + 1

        def then(settled: int) -> None:
            left = self._late_asking.get(device, 1) - 1
            if left > 0:
                self._late_asking[device] = left
            else:
                self._late_asking.pop(device, None)
            self._told_late(device, rid, results, settled, finished_here=finished_here, looked_up=True)

        try:
            self.on_late(device, rid, results, then)
        except Exception:
            logger.exception("could not record the late results of batch %s from device %s", rid, device)
            then(0)

    def _told_late(self, device: str, rid: str, results: list[Result], settled: int, *, finished_here: bool,
                   looked_up: bool) -> None:
        """What became of late results: the device's misses counted, and logged."""
        if looked_up:
            if settled:
                self._late_misses.pop(device, None)
            else:
                misses = self._late_misses.get(device, 0)
                self._late_misses[device] = misses + 1
                if misses + 1 == _LATE_MISSES:
                    logger.warning("device %s sent %d results in a row for no open outcome: its late results are "
                                   "no longer looked up", device, _LATE_MISSES)
                while len(self._late_misses) > _FINISHED_MEMORY:
                    self._late_misses.pop(next(iter(self._late_misses)))
        if settled:
            logger.warning("late results from device %s for batch %s recorded (%d call(s): %s)", device, rid,
                           settled, [r.call_id for r in results])
        elif finished_here:
            logger.info("late results from device %s for finished batch %s: already recorded (call_ids %s)",
                        device, rid, [r.call_id for r in results])
        else:
            logger.warning("refused results from device %s for batch %s: no such batch was sent to it, or its "
                           "outcome is already recorded", device, rid)

    def finish(self, batch: PendingBatch, error: str | None = None, *, pending: bool = False) -> None:
        """End `batch`: its waiters wake. `error` is why the calls without a result have none; with
        `pending` they may still be running (the wait ended, not the command), and say so."""
        if batch.done.is_set():
            return
        batch.pending = pending and bool(batch.outstanding) and batch.sent
        self.pending.pop(batch.response_id, None)
        self._finished[batch.response_id] = batch.device
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)
        if batch.outstanding:
            batch.error = error or "the device sent no result for this command"
        batch.done.set()
        if batch.remote is not None and batch.remote is not asyncio.current_task():
            batch.remote.cancel()  # a cancel or timeout here: the holding node stops it on the device too
        record = self.registry.get(batch.device)
        if record is not None:
            record.inflight = max(0, record.inflight - 1)
            self.registry.notify()

    def fail_device(self, device: str, error: str, *, sent_only: bool = False, pending: bool = False) -> None:
        """Fail the batches this node sent `device` itself (those another node runs end there); with
        `pending`, those already sent end "outcome pending" (they may still be running)."""
        for batch in [b for b in self.pending.values()
                      if b.device == device and b.remote is None and (b.sent or not sent_only)]:
            self.finish(batch, error, pending=pending)

    def finish_all(self, error: str, *, pending: bool = False) -> None:
        for batch in list(self.pending.values()):
            self.finish(batch, error, pending=pending)

    def to_send(self, device: str, *, resend: bool) -> list[PendingBatch]:
        """The batches for `device` that go out after its (re)registration; see `DeviceHub._flush`."""
        return [b for b in self.pending.values() if b.device == device and b.remote is None and (resend or not b.sent)]

    def of_device(self, device: str) -> list[PendingBatch]:
        return [b for b in self.pending.values() if b.device == device]

    def running_call(self, device: str, call_id: str) -> PendingBatch | None:
        """The batch sent to `device` that still waits for `call_id`'s result, or None."""
        return next((b for b in self.pending.values()
                     if b.device == device and b.sent and call_id in b.outstanding), None) if call_id else None

    def registered(self, device: str) -> None:
        """`device` (re)registered: its late results are looked up again (see `_late`)."""
        self._late_misses.pop(device, None)

    def queue_cancel(self, device: str, response_id: str) -> None:
        self._cancels.setdefault(device, []).append(response_id)

    def take_cancels(self, device: str) -> list[str]:
        return self._cancels.pop(device, [])

    def forget_cancels(self, device: str) -> None:
        self._cancels.pop(device, None)
