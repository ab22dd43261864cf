"""`BatchRunner`: the device's side of a COMMAND — in arrival order per session, exactly once.

Seed 001 runs one task at a time under `task_lock`; here that lock is per session: a session's
batches run one at a time in arrival order, while batches of different sessions (a batch's
`session_id`; batches without one form one session) run side by side, at most
`max_concurrent_sessions` at once. A session beyond that waits for a slot, first come first
served, and its waiting batch is told its place with a `queued` event (`data.position`, 1 = next)
whenever the place changes. A batch that only lists tools waits for nothing: it answers from
what the device already knows, so a listing never sits behind a running command.
Each batch has a task of its own, so the connection's reader stays free to answer heartbeats and
cancellations while batches run.
Batches belong to the runner, not to a connection: a dropped socket does not cancel work, and
the results land in the outbox to be delivered after the next registration.

Each result goes out as soon as it exists (one frame per result, CONTINUE then a final COMPLETED;
a one-command batch is a single COMPLETED frame). A batch's `timeout` and a server CANCEL cancel
the running tool — tools kill their process groups on cancellation — and every command without a
result gets a failure saying why. Commands that started are kept in the `FinishedRecord` under
their batch's server-issued `response_id` and their `call_id`: the same batch sent again (after a
reconnect) is answered from it and never run twice, while another batch that reuses a `call_id`
(a caller's label) is a new call — it neither runs twice nor receives someone else's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from tether.device.client import DeviceClient
from tether.device.link.batch import Batch
from tether.device.link.finished import FinishedRecord
from tether.device.link.outbox import Outbox, results_frame
from tether.device.link.run_here import run_in_this_task
from tether.device.link.session_line import SessionLine
from tether.protocol.messages import (
    OUTCOME_FINISHED,
    OUTCOME_RUNNING,
    OUTCOME_UNKNOWN,
    CallOutcome,
    ClientMessage,
    ClientMessageType,
    Event,
    ServerMessage,
)
from tether.protocol.models import Result, ResultStatus

logger = logging.getLogger(__name__)

CANCELLED_BY_SERVER = "cancelled by the server"
DEFAULT_MAX_CONCURRENT_SESSIONS = 4
SHUTTING_DOWN = "not run: the device is shutting down"
# the command that was running when the device stopped: it may have done some or all of its work
SHUTDOWN_WHILE_RUNNING = ("outcome unknown: the command was running when the device shut down and was stopped; "
                          "it may have made some or all of its changes")


class BatchRunner:
    """Accepts COMMAND messages, runs them on a `DeviceClient`, and puts results in the outbox.

    There is no long-lived worker: a finishing batch starts the next one in a task of its own, and a
    batch that can start when it arrives is run by the connection's reader itself, in its own task
    (see `submit(run_here=True)`): no task is created and no event-loop turn is spent for it.
    """

    def __init__(self, client: DeviceClient, outbox: Outbox, record: FinishedRecord,
                 client_id: str | None = None, *,
                 max_concurrent_sessions: int = DEFAULT_MAX_CONCURRENT_SESSIONS) -> None:
        self.client = client
        self.outbox = outbox
        self.record = record
        self.client_id = client_id
        self.active: dict[str, Batch] = {}  # response_id → batch, queued or running
        self.idle = asyncio.Event()
        self.idle.set()
        self.executed = 0  # commands handed to the router (not replayed): tests count on it
        self.line: SessionLine[Batch] = SessionLine(max_concurrent_sessions)  # who runs next
        self._here: Batch | None = None  # the batch `submit` last returned to run in the caller's task
        self._unarmed: Batch | None = None  # that batch, when its timer waits for its first wait (`run_here`)

    @property
    def running(self) -> int:
        """Batches accepted and not finished (queued or running): the heartbeat's load figure."""
        return len(self.active)

    def set_limit(self, max_concurrent_sessions: int) -> None:
        """A new `max_concurrent_sessions` (a policy change): more slots start waiting sessions at once;
        fewer let the running ones finish."""
        self.line.limit = max(1, max_concurrent_sessions)
        self._pump()

    @property
    def max_concurrent_sessions(self) -> int:
        return self.line.limit

    @property
    def started(self) -> int:
        """Batches running now (each session's current one, and listings)."""
        return self.line.started

    @property
    def queued(self) -> int:
        """Batches accepted and not started: behind their session's running batch, or waiting for a slot."""
        return len(self.active) - self.started

    # ------------------------------------------------------------------ accepting and cancelling

    def submit(self, msg: ServerMessage, *, run_here: bool = False) -> Coroutine[Any, Any, None] | None:
        """Queue a batch; a batch already queued or running is not queued twice, and one whose
        calls all finished earlier is answered from the record at once.

        With `run_here`, a batch that can start at once gets no task: its coroutine is returned and
        the caller must run it at once, in its own task, with `run_here` (that task is then the
        batch's: its timeout and cancellation apply to it)."""
        if msg.response_id in self.active:
            logger.info("batch %s is already queued or running: duplicate ignored", msg.response_id)
            return None
        batch = Batch(msg)
        if msg.timeout is not None:  # from its arrival: time spent waiting in line counts
            batch.deadline = asyncio.get_running_loop().time() + msg.timeout
        record = self.record
        if all(key in record for key in batch.keys):
            logger.info("batch %s was already executed: answering from the record", msg.response_id)
            for i in range(len(batch.actions)):
                self._deliver(batch, i, self._recorded(batch, i))
            return None
        self.active[msg.response_id] = batch
        self.idle.clear()
        if batch.immediate:
            self.line.immediate.add(batch)
            coro = self._start(batch, here=run_here)
        else:
            self.line.add(batch)  # behind its session's earlier batches, and in line for a slot
            coro = self._pump(here=run_here)
        if batch.deadline is not None:  # a plain timer, not asyncio.timeout: it ends the batch like a CANCEL does
            here, self._here = self._here, None
            if coro is not None and here is batch:
                # run by the caller from now on (`run_here`): nothing but a wait of the batch lets the loop run,
                # so its timer is armed at that first wait, for the same deadline (most batches never wait)
                self._unarmed = batch
            else:
                self._arm(batch)
        return coro

    async def run_here(self, coro: Coroutine[Any, Any, None], on_wait: Callable[[], None]) -> bool:
        """Run the coroutine `submit(run_here=True)` returned, at once, in the calling task
        (`run_in_this_task`): at its first wait the batch's timer is armed, then `on_wait` is called (the
        caller lets go of whatever else it did: the task is the batch's from then on). True when it waited."""
        batch, self._unarmed = self._unarmed, None

        def waits() -> None:
            if batch is not None:
                self._arm(batch)
            on_wait()

        return await run_in_this_task(coro, waits)

    def _arm(self, batch: Batch) -> None:
        if batch.deadline is not None and batch.timer is None and not batch.done:
            batch.timer = asyncio.get_running_loop().call_at(batch.deadline, self._expire, batch)

    def cancel(self, response_id: str, reason: str = CANCELLED_BY_SERVER) -> bool:
        """Cancel a queued or running batch; its unfinished commands fail with `reason`."""
        batch = self.active.get(response_id)
        if batch is None or batch.cancel_reason is not None:
            return False
        batch.cancel_reason = reason
        if batch.task is not None:
            batch.task.cancel()
        else:  # still queued: answer now; it is skipped when its turn comes
            self._finish(batch, reason)
            self._pump()  # the places of those behind it move up
        return True

    def outcome_of(self, call_id: str, response_id: str | None) -> CallOutcome:
        """What this device knows of one earlier call, for an OUTCOME_QUERY: `finished` with its result
        from the record, `running` while its batch is queued or running, else `unknown`. Report-only: it
        runs, queues and changes nothing. Without `response_id` the call_id alone must name exactly one
        call (a caller may reuse a call_id in other batches): several matches are `unknown`."""
        if response_id:
            keys: list[tuple[str, str]] = [(response_id, call_id)]
        else:
            keys = self.record.calls(call_id)
            keys += [(rid, call_id) for rid, b in self.active.items()
                     if any(c.call_id == call_id for c in b.actions) and (rid, call_id) not in keys]
            if len(keys) > 1:
                return CallOutcome(call_id=call_id, state=OUTCOME_UNKNOWN,
                                   note=f"call_id {call_id} names {len(keys)} calls here: give its batch's response_id")
            if not keys:
                return CallOutcome(call_id=call_id, state=OUTCOME_UNKNOWN, note="this device has no record of it")
        rid, cid = keys[0]
        result = self.record.get((rid, cid))
        if result is not None:
            return CallOutcome(call_id=cid, state=OUTCOME_FINISHED, response_id=rid, result=result)
        batch = self.active.get(rid)
        if batch is not None and not batch.done:
            for i, command in enumerate(batch.actions):
                if command.call_id == cid and batch.slots[i] is None:
                    return CallOutcome(call_id=cid, state=OUTCOME_RUNNING, response_id=rid)
                if command.call_id == cid and batch.slots[i] is not None:  # finished, never recorded (no key)
                    return CallOutcome(call_id=cid, state=OUTCOME_FINISHED, response_id=rid, result=batch.slots[i])
        return CallOutcome(call_id=cid, state=OUTCOME_UNKNOWN, response_id=rid,
                           note="this device has no record of it (never received, or forgotten)")

    def orphan_all(self, reason: str) -> int:
        """Stop every batch no server waits for any more (the server restarted, or gave up on this
        device after its grace period): a command left running, say a long `sleep`, would otherwise
        hold up the batches the new session sends. Their results (the cancellation's failures, or what
        finished first) are still sent: the server records them as late outcomes (docs/outcomes.md)."""
        count = 0
        for response_id, batch in list(self.active.items()):
            batch.orphaned = True
            count += self.cancel(response_id, reason)
        return count

    async def abort_all(self, reason: str = SHUTTING_DOWN, timeout: float = 10.0) -> None:
        """Cancel every batch and wait (bounded) until their failure results are in the outbox."""
        for response_id in list(self.active):
            self.cancel(response_id, reason)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.idle.wait()

    # ------------------------------------------------------------------ running

    def _pump(self, *, here: bool = False) -> Coroutine[Any, Any, None] | None:
        """Start what the line lets start, then tell those still waiting their place if it changed.
        With `here`, the first batch started is returned instead of given a task."""
        returned: Coroutine[Any, Any, None] | None = None
        for batch in self.line.take():
            coro = self._start(batch, here=here and returned is None)
            returned = returned or coro
        for batch, place in self.line.moved():
            self._queued_event(batch, place)
        return returned

    def _start(self, batch: Batch, *, here: bool) -> Coroutine[Any, Any, None] | None:
        batch.position = 0
        if here:
            self._here = batch
            return self._run_batch(batch)
        batch.task = asyncio.create_task(self._run_batch(batch), name=f"batch-{batch.msg.response_id}")
        batch.task.add_done_callback(lambda _task: self._task_ended(batch))
        return None

    def _ended(self, batch: Batch) -> None:
        """A batch is over: its slot goes to the next session in line."""
        self.line.ended(batch)
        self._pump()

    def _queued_event(self, batch: Batch, place: int) -> None:
        if batch.orphaned:
            return
        message = ClientMessage(type=ClientMessageType.EVENT, client_id=self.client_id, payload=Event(
            kind="queued", response_id=batch.msg.response_id, data={
                "position": place, "max_concurrent_sessions": self.max_concurrent_sessions,
                "reason": f"the device runs {self.max_concurrent_sessions} sessions at once; this batch is "
                          f"number {place} in line"}).model_dump())
        self.outbox.put_event(message)

    def _task_ended(self, batch: Batch) -> None:
        """A batch's task cancelled before its first step never ran `_run_batch`, so nothing answered
        its commands or started the next batch: do both here (a no-op for a batch that ran)."""
        if batch.done:
            return
        self._finish(batch, batch.cancel_reason or "cancelled")
        self._ended(batch)

    async def _run_batch(self, batch: Batch) -> None:
        """Run one batch under its timeout; a cancel (ours, or the timeout's) fails what is left."""
        batch.task = asyncio.current_task()
        timeout = batch.msg.timeout
        reason: str | None = None
        try:
            try:
                if batch.deadline is not None and asyncio.get_running_loop().time() >= batch.deadline:
                    reason = _timed_out_waiting(timeout)  # its time went waiting in line: nothing of it runs
                else:
                    await self._run_commands(batch)
            except TimeoutError:
                reason = _timed_out(timeout)
            except asyncio.CancelledError:
                if batch.cancel_reason is None:  # not ours (the loop is shutting down): let it through
                    self._finish(batch, "cancelled")
                    raise
                reason = batch.cancel_reason
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
            except Exception as exc:
                logger.exception("batch %s failed inside the device", batch.msg.response_id)
                reason = f"device error while running the batch: {exc!r}"
            self._finish(batch, reason)
        finally:
            self._ended(batch)

    def _expire(self, batch: Batch) -> None:
        """The batch's timeout fired: it is cancelled as a CANCEL from the server would, saying why."""
        if batch.cancel_reason is None and not batch.done and batch.task is None:  # still waiting in line
            self.cancel(batch.msg.response_id, _timed_out_waiting(batch.msg.timeout))
        elif batch.cancel_reason is None and not batch.done and batch.task is not None:
            batch.cancel_reason = _timed_out(batch.msg.timeout)
            batch.task.cancel()

    async def _run_commands(self, batch: Batch) -> None:
        """Run the batch's commands in order: recorded ones are replayed, runs of new ones go to the
        router in one call (the hot path: one call for the whole batch)."""
        actions, keys, record = batch.actions, batch.keys, self.record
        count = len(actions)
        if count == 1 and keys[0] not in record:  # the common batch: one command, not run before
            await self._execute_run(batch, [0])
            return
        seen: set[str | None] = set()
        i = 0
        while i < count:
            if i and batch.msg.early_exit and any(r is not None and r.status is ResultStatus.FAILURE
                                                  for r in batch.slots[:i]):
                for j in range(i, count):
                    recorded = record.get(keys[j])
                    self._deliver(batch, j, recorded or Result.skipped(
                        "skipped: an earlier command of this batch failed", actions[j].call_id))
                return
            if keys[i] in record or actions[i].call_id in seen:
                self._deliver(batch, i, self._recorded(batch, i))
                i += 1
                continue
            run: list[int] = []
            while i < count and keys[i] not in record and actions[i].call_id not in seen:
                seen.add(actions[i].call_id)
                run.append(i)
                i += 1
            await self._execute_run(batch, run)

    async def _execute_run(self, batch: Batch, positions: list[int]) -> None:
        msg, actions, keys = batch.msg, batch.actions, batch.keys
        commands = [actions[p] for p in positions]
        done = 0

        def on_result(result: Result) -> None:
            nonlocal done
            position = positions[done]
            done += 1
            batch.current = positions[done] if done < len(positions) else None
            if result.status is not ResultStatus.SKIPPED:
                self.record.add(keys[position], result)
            self._deliver(batch, position, result)

        # the session's order is kept by the runner (one batch per session at a time), so sessions do
        # not share the client's single task_lock nor its session fields: the context goes with the call
        batch.current = positions[0]
        self.executed += len(commands)
        await self.client.command_router.execute(
            msg.agent_name, msg.process_name, msg.root_name, commands, msg.early_exit,
            session_id=msg.session_id, emit=self.emitter(batch), on_result=on_result, deadline=batch.deadline)
        batch.current = None

    def _recorded(self, batch: Batch, position: int) -> Result:
        result = self.record.get(batch.key(position))
        if result is None:  # a duplicate call_id inside one batch whose first copy never finished
            call_id = batch.actions[position].call_id
            return Result.failure(f"call_id {call_id} appears twice in the batch and did not finish", call_id)
        return result

    def _finish(self, batch: Batch, reason: str | None) -> None:
        """Fail every command without a result, remember the one that may have run, close the batch."""
        if batch.done:
            return
        for i, slot in enumerate(batch.slots):
            if slot is not None:
                continue
            call_id = batch.actions[i].call_id
            why = reason or "the device finished the batch without a result"
            if i == batch.current and reason == SHUTTING_DOWN:  # it ran, and may have done its work
                why = SHUTDOWN_WHILE_RUNNING
            result = Result.failure(why, call_id)
            if i == batch.current:
                self.record.add(batch.key(i), result)  # it may have had effects: never run it again
            self._deliver(batch, i, result)
        batch.done = True
        if batch.timer is not None:
            batch.timer.cancel()
        self.active.pop(batch.msg.response_id, None)
        if not self.active:
            self.idle.set()

    # ------------------------------------------------------------------ results and events

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


def _timed_out(timeout: float | None) -> str:
    return f"timed out after {timeout:g}s (the batch's timeout); the running command was cancelled and its " \
           "processes killed"


def _timed_out_waiting(timeout: float | None) -> str:
    return f"timed out after {timeout:g}s (the batch's timeout) waiting in line for the device, which was running " \
           "as many sessions as it may; nothing of the batch ran"
