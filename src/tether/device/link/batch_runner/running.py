"""Running batches: the line of sessions started as slots free up (`_pump`, with a `queued` event telling a waiting
batch its place), one batch run under its timeout in its own task, its commands replayed from the record or sent
to the router, and a batch cancelled or finished with a failure for every command left without a result."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from tether.device.link.batch import Batch
from tether.device.link.batch_runner.reasons import CANCELLED_BY_SERVER, SHUTDOWN_WHILE_RUNNING, SHUTTING_DOWN
from tether.device.link.batch_runner.results import ResultDelivery
from tether.device.link.finished import FinishedRecord
from tether.device.link.session_line import SessionLine
from tether.protocol.messages import ClientMessage, ClientMessageType, Event
from tether.protocol.models import Result, ResultStatus

if TYPE_CHECKING:
    from tether.device.client import DeviceClient

logger = logging.getLogger(__package__)


class BatchRun(ResultDelivery):
    """The running part of `tether.device.link.batch_runner.BatchRunner`, which sets every attribute below in its
    constructor."""

    client: DeviceClient
    record: FinishedRecord
    active: dict[str, Batch]
    idle: asyncio.Event
    executed: int
    line: SessionLine[Batch]
    _here: Batch | None

    @property
    def max_concurrent_sessions(self) -> int:
        """How many sessions may run a batch at once (`set_limit` changes it)."""
        return self.line.limit

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


def _timed_out(timeout: float | None) -> str:
    return f"timed out after {timeout:g}s (the batch's timeout); the running command was cancelled and its " \
           "processes killed"


def _timed_out_waiting(timeout: float | None) -> str:
    return f"timed out after {timeout:g}s (the batch's timeout) waiting in line for the device, which was running " \
           "as many sessions as it may; nothing of the batch ran"
