"""Accepting batches: a COMMAND queued, answered from the record, or handed back to run in the caller's task
(`submit`, `run_here`), its timer armed; what the device knows of an earlier call (`outcome_of`); every batch
stopped at once (`orphan_all`, `abort_all`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from tether.device.link.batch import Batch
from tether.device.link.batch_runner.reasons import SHUTTING_DOWN
from tether.device.link.batch_runner.running import BatchRun
from tether.device.link.run_here import run_in_this_task
from tether.protocol.messages import (
    OUTCOME_FINISHED,
    OUTCOME_RUNNING,
    OUTCOME_UNKNOWN,
    CallOutcome,
    ServerMessage,
)

logger = logging.getLogger(__package__)


class BatchIntake(BatchRun):
    """The accepting part of `tether.device.link.batch_runner.BatchRunner`, which sets `_unarmed` in its
    constructor."""

    _unarmed: Batch | None

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
