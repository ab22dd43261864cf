"""Where tasks live between runs: one SQLite file (or the server's PostgreSQL database), each task stored
whole as its JSON in the `tasks` table (`tether.server.store.tasks`, where its statements are).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

from tether.agent.run.task import TERMINAL_STATES, Task, TaskEvent, TaskState
from tether.server.store import StoreUnavailable
from tether.server.store.tasks import TaskTable

logger = logging.getLogger(__name__)

# The events after which a running task is saved; streamed output and answer tokens are saved
# with the next of these (saving on each would rewrite the task per line of output).
SAVE_ON = frozenset({"plan", "step_started", "step_finished", "decision", "patched", "skipped", "question",
                     "user_answer", "state", "answer", "interrupted", "server_restarted", "waiting_for_device"})


class TaskStore:
    """The tasks, each stored whole as its JSON, in their table (`tether.server.store.tasks.TaskTable`)."""

    def __init__(self, path: str | Path) -> None:
        """A SQLite file, or the server's PostgreSQL database (a `postgresql://` URL); `StoreUnavailable`
        in one line when it cannot be opened or reached."""
        self.table = TaskTable(path)
        self.where, self.path = self.table.where, self.table.path

    def close(self) -> None:
        self.table.close()

    def save(self, task: Task) -> None:
        """Store the task whole; `StoreUnavailable` when the disk is full or read-only."""
        self.table.save(*row_of(task))

    async def saved(self, task: Task) -> None:
        """`save` without holding up the event loop (PostgreSQL: on the table's worker, `TaskTable.call`)."""
        await self.table.call(self.table.save, *row_of(task))

    def get(self, task_id: str) -> Task | None:
        """The task with this id, or with this unique id prefix (ids are long to type)."""
        try:
            return self.find(task_id)
        except LookupError:
            return None

    def find(self, task_id: str) -> Task:
        """The task with this id or unique id prefix; `LookupError` saying which of none/several."""
        rows = self.table.bodies(task_id)
        if not rows:
            raise LookupError(f"no task '{task_id}' on this machine; 'tether tasks' lists them")
        if len(rows) > 1:
            raise LookupError(f"'{task_id}' is the start of several tasks' ids; give more of it")
        return Task.model_validate_json(rows[0])

    def mark_interrupted(self, locks: RunLocks) -> builtins.list[str]:
        """Tasks left unfinished by a tether process that is gone (its run lock is free) become
        `interrupted`, so `tether tasks` never shows a dead task as running; their ids."""
        marked = []
        for stale in self.unfinished():
            with locks.held(stale.id, wait=False) as mine:
                task = self.get(stale.id) if mine else None  # read again: it may have ended meanwhile
                if task is None or task.state.terminal or task.state is TaskState.INTERRUPTED:
                    continue  # its process still runs it, or ended it just now
                event = task.transition(TaskState.INTERRUPTED, error="the tether process running it stopped")
                task.error = "interrupted: the tether process running it stopped before it ended"
                if event is not None:
                    self.save(task)
                    marked.append(task.id)
        return marked

    def list(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        """Newest first; each row is id, request, state, device, requested_by (who asked: what a person
        approving sees), created_at, updated_at."""
        return self.table.rows(limit, state)

    def ids(self) -> builtins.list[str]:
        """Every task's id (each is the undo session of the task's commands)."""
        return self.table.ids()

    def unfinished(self) -> builtins.list[Task]:
        """Tasks not done, failed or cancelled: what a restarted server must resume or settle."""
        ended = (*(s.value for s in TERMINAL_STATES), TaskState.INTERRUPTED.value)
        return [Task.model_validate_json(body) for body in self.table.bodies_not_in(ended)]


def last_seq(task: Task) -> int:
    """The seq of the task's last event (-1: it has none)."""
    return task.events[-1].seq if task.events else -1


def row_of(task: Task) -> tuple[str, str, str, str, str, str]:
    """The task's row as `TaskTable.save` takes it, serialised now (the task goes on changing)."""
    return (task.id, task.request, task.state.value, task.created_at.isoformat(), task.updated_at.isoformat(),
            task.model_dump_json())


class RunLocks:
    """Which local tasks a live tether process is running: each holds an flock on its task's file in
    `directory` for as long as it runs. The kernel drops the lock when the process dies however it
    dies (SIGKILL too), so a free lock on an unfinished task means nobody runs it any more."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @contextlib.contextmanager
    def held(self, task_id: str, *, wait: bool = True) -> Iterator[bool]:
        """Hold the task's lock; yields False (without it) when `wait` is off and another process has it."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.directory / f"{task_id}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()
        finally:
            os.close(fd)


class SaveSoon:
    """Saves running tasks once per turn of the event loop instead of once per event.

    A step's end, the cursor moving on and the next step's start all happen between two awaits, so
    they cost one write. `flush()` writes what is waiting at once: call it before anything leaves
    the process that a restart must know about (a command about to be sent) and at the end.

    A save that fails (a full or read-only disk) never raises into the loop: the task is kept in
    `unsaved` (the state readers must be shown, since the store is behind) and saved again every
    `retry_s` seconds and at every flush until it is written.

    With PostgreSQL (`TaskTable.offload`) the rows are serialised on the loop and written on the table's
    worker: `flush` hands them over without waiting (and answers what is known: the last problem), and
    `flushed` waits for them — what must be saved before a command goes awaits that.

    `save_then` runs a callback once a task's row, as it is at the call, is written: what must not be told
    before it is stored (a task's end) waits on it, through any number of failed writes and their retries.
    `then` does the same at the next write of the loop's turn, and tells its callback which of the task's
    events that row held (what must be saved before it is relayed: the task's events, `Running._on_event`).
    """

    retry_s = 1.0

    def __init__(self, store: TaskStore) -> None:
        self.store = store
        self._dirty: dict[str, Task] = {}
        self.unsaved: dict[str, Task] = {}
        self.problem: str | None = None  # why the last save failed; None once everything is saved
        self._retry: asyncio.TimerHandle | None = None
        self._writing: Future[dict[str, str]] | None = None  # the last group handed to the worker (PostgreSQL)
        # task id → called once its next write succeeds, with the seq of the last event that row held
        self._after: dict[str, list[Callable[[int], None]]] = {}

    def on_event(self, task: Task, event: TaskEvent | None) -> None:
        if event is not None and event.kind in SAVE_ON:
            self.mark(task)

    def mark(self, task: Task) -> None:
        if not self._dirty:
            asyncio.get_running_loop().call_soon(self.flush)
        self._dirty[task.id] = task

    def save(self, *tasks: Task) -> str | None:
        """Save `tasks` now (and whatever waits); None when saved, else why not (they are kept and retried)."""
        for task in tasks:
            self._dirty[task.id] = task
        return self.flush()

    def flush(self) -> str | None:
        """Write what is waiting and what failed before; None when all of it is saved, else why not. With
        PostgreSQL it is handed to the table's worker and the answer is what is known now (`flushed` waits)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        dirty, self._dirty = {**self.unsaved, **self._dirty}, {}
        if self.store.table.offload:
            self._hand_over(dirty)
            return self.problem
        problem = None
        written: list[Callable[[], None]] = []
        for task in dirty.values():
            try:
                self.store.save(task)
            except Exception as exc:  # a full disk must not kill the loop; the task is kept and retried
                if self.problem is None:
                    logger.error("could not save task %s (kept in memory, retried every %gs): %s", task.id,
                                 self.retry_s, exc, exc_info=not isinstance(exc, StoreUnavailable))
                problem = str(exc)
                self.unsaved[task.id] = task
            else:
                self.unsaved.pop(task.id, None)
                seq = last_seq(task)
                written.extend(partial(callback, seq) for callback in self._after.pop(task.id, ()))
        if problem is None and self.problem is not None:
            logger.warning("tasks can be saved again")
        self.problem = problem
        if self.unsaved:
            try:
                self._retry = asyncio.get_running_loop().call_later(self.retry_s, self.flush)
            except RuntimeError:
                pass  # no loop (closing): the caller reports what stays unsaved
        for callback in written:
            callback()
        return problem

    async def flushed(self) -> str | None:
        """`flush`, then wait until what was handed over is written: None when all of it is saved, else why
        not. The event loop goes on meanwhile (PostgreSQL)."""
        problem = self.flush()
        writing = self._writing
        if writing is None:
            return problem
        try:
            await asyncio.shield(asyncio.wrap_future(writing))
        except Exception as exc:  # the worker is gone (closing)
            return str(exc)
        await asyncio.sleep(0)  # its settling, called soon on this loop, has run
        return self.problem

    def save_then(self, task: Task, callback: Callable[[], None]) -> None:
        """Save `task` now and call `callback` (on this loop) once that row is written, never before: at once on
        SQLite when the write succeeds; on PostgreSQL once the table's worker has written it. A failed write
        keeps the task in `unsaved` and retries it every `retry_s` seconds; `callback` waits for the write that
        succeeds. It is never called when the task is `forget`-ten or nothing succeeds before the server closes
        (the store then holds the task's older row, which is what a restart finds)."""
        self._after.setdefault(task.id, []).append(lambda _seq: callback())
        self.save(task)

    def then(self, task: Task, callback: Callable[[int], None]) -> None:
        """Mark `task` to be saved at the end of this turn of the loop (as `mark`) and call `callback(seq)` once a
        row of it is written: `seq` is the last of the task's events that row holds (-1: none), so the events
        up to it are stored. Through failed writes and retries as `save_then`; never called for a task
        `forget`-ten or when nothing is written before the server closes."""
        self._after.setdefault(task.id, []).append(callback)
        self.mark(task)

    def _hand_over(self, dirty: dict[str, Task]) -> None:
        """PostgreSQL: write `dirty` on the table's worker, in order after what was handed over before; what
        fails is kept in `unsaved` and retried, as on SQLite."""
        if not dirty:
            return
        loop = asyncio.get_running_loop()
        rows = {task_id: row_of(task) for task_id, task in dirty.items()}
        seqs = {task_id: last_seq(task) for task_id, task in dirty.items()}  # what each row holds, as serialised
        after = {task_id: self._after.pop(task_id) for task_id in rows if task_id in self._after}
        table = self.store.table

        def work() -> dict[str, str]:
            failed: dict[str, str] = {}
            for task_id, row in rows.items():
                try:
                    table.save(*row)
                except Exception as exc:
                    failed[task_id] = str(exc)
            return failed

        def settle(future: Future[dict[str, str]]) -> None:
            try:
                failed = future.result()
            except Exception as exc:
                failed = {task_id: str(exc) for task_id in rows}
            written: list[Callable[[], None]] = []
            for task_id, task in dirty.items():
                if task_id in failed:
                    self.unsaved.setdefault(task_id, task)
                    if task_id in after:  # they wait for the retry's write (before any given since)
                        self._after[task_id] = [*after[task_id], *self._after.get(task_id, ())]
                else:
                    self.unsaved.pop(task_id, None)
                    written.extend(partial(callback, seqs[task_id]) for callback in after.get(task_id, ()))
            problem = next(iter(failed.values()), None)
            if problem is not None and self.problem is None:
                logger.error("could not save %d task(s) (kept in memory, retried every %gs): %s", len(failed),
                             self.retry_s, problem)
            elif problem is None and self.problem is not None and not self.unsaved:
                logger.warning("tasks can be saved again")
            self.problem = problem if problem is not None else (self.problem if self.unsaved else None)
            if self.unsaved and self._retry is None:
                with contextlib.suppress(RuntimeError):
                    self._retry = loop.call_later(self.retry_s, self.flush)
            for callback in written:
                callback()

        try:
            future = table.submit(work)
        except RuntimeError as exc:  # closed
            future = Future()
            future.set_exception(exc)
        self._writing = future

        def settle_soon(done: Future[dict[str, str]]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped
                loop.call_soon_threadsafe(settle, done)

        future.add_done_callback(settle_soon)

    async def saved(self, *tasks: Task) -> str | None:
        """Save `tasks` (and whatever waits) and wait until written: None when saved, else why not (they are
        kept and retried). The event loop goes on meanwhile (PostgreSQL)."""
        for task in tasks:
            self._dirty[task.id] = task
        return await self.flushed()

    def forget(self, task_id: str) -> None:
        """Drop a task that was never created (its first save failed and the caller was told), or whose record
        another server owns now: nothing of it is written or retried from here, and what waited on it is not
        called."""
        self.unsaved.pop(task_id, None)
        self._dirty.pop(task_id, None)
        self._after.pop(task_id, None)

    def cancel(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
