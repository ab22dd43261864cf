"""Where tasks live between runs: one SQLite file, each task stored whole as its JSON.

A task is small and always read whole (its log is its record), so a row per task with the
serialized `Task` is simpler than a table per part and keeps every field the executor adds.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tether.agent.task import TERMINAL_STATES, Task, TaskEvent, TaskState
from tether.server.store import StoreUnavailable, disk_problem
from tether.server.store.engine import PostgresConnection, create_schema, describe, is_url, open_postgres

logger = logging.getLogger(__name__)

# The events after which a running task is saved; streamed output and answer tokens are saved
# with the next of these (saving on each would rewrite the task per line of output).
SAVE_ON = frozenset({"plan", "step_started", "step_finished", "decision", "patched", "skipped", "question",
                     "user_answer", "state", "answer", "interrupted", "server_restarted", "waiting_for_device"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    request TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_updated ON tasks (updated_at);
"""


class TaskStore:
    def __init__(self, path: str | Path) -> None:
        """A SQLite file, or the server's PostgreSQL database (a `postgresql://` URL)."""
        self.where = describe(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | PostgresConnection
        if is_url(path):
            self.path = Path(self.where)
            self._conn = open_postgres(str(path))  # StoreUnavailable in one line when it cannot be reached
            create_schema(self._conn, _SCHEMA)
            return
        self.path = Path(path).expanduser()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # tasks hold file contents and command output: only their owner reads them (as server.db)
            # created 0600 only when missing: closing a descriptor of a database this process already has
            # open (the server's Store, same file) drops every POSIX lock the process holds on it, and then
            # another process's SQLite deletes the WAL the server still writes to (committed rows lost)
            if not self.path.exists():
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
                os.close(fd)
            for name in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
                if name.exists() and name.stat().st_mode & 0o077:
                    name.chmod(0o600)
            self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            # WAL with synchronous=NORMAL survives a crash of the process (what a restarted server meets);
            # only a power cut may lose the last saves. FULL costs an fsync per save, i.e. per step.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            create_schema(self._conn, _SCHEMA)
        except (sqlite3.Error, OSError) as exc:  # a full or read-only state directory: say so in one line
            raise StoreUnavailable(disk_problem(exc, self.path) or f"cannot open {self.path}: {exc}") from None

    def execute_schema(self, schema: str) -> None:
        """Create a table of another agent module (task leases) on this store's connection."""
        with self._lock:
            create_schema(self._conn, schema)

    def write(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """One writing statement; the rows it changed. `StoreUnavailable` when the disk or database is gone."""
        try:
            with self._lock:
                return self._conn.execute(sql, params).rowcount
        except sqlite3.Error as exc:
            problem = disk_problem(exc, self.path)
            if problem is None:
                raise
            raise StoreUnavailable(problem) from None

    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def save(self, task: Task) -> None:
        """Store the task whole; `StoreUnavailable` when the disk is full or read-only."""
        row = (task.id, task.request, task.state.value, task.created_at.isoformat(), task.updated_at.isoformat(),
               task.model_dump_json())
        try:
            with self._lock:
                self._conn.execute(
                    "INSERT INTO tasks (id, request, state, created_at, updated_at, body) VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET state=excluded.state, updated_at=excluded.updated_at, "
                    "body=excluded.body", row)
        except sqlite3.Error as exc:
            problem = disk_problem(exc, self.path)
            if problem is None:
                raise
            raise StoreUnavailable(problem) from None

    def get(self, task_id: str) -> Task | None:
        """The task with this id, or with this unique id prefix (ids are long to type)."""
        try:
            return self.find(task_id)
        except LookupError:
            return None

    def find(self, task_id: str) -> Task:
        """The task with this id or unique id prefix; `LookupError` saying which of none/several."""
        prefix = task_id.replace("%", "").replace("_", "")
        with self._lock:
            exact = self._conn.execute("SELECT body FROM tasks WHERE id = ?", (task_id,)).fetchone()
            rows = [exact] if exact else self._conn.execute(
                "SELECT body FROM tasks WHERE id LIKE ? LIMIT 2", (prefix + "%",)).fetchall() if prefix else []
        if not rows:
            raise LookupError(f"no task '{task_id}' on this machine; 'tether tasks' lists them")
        if len(rows) > 1:
            raise LookupError(f"'{task_id}' is the start of several tasks' ids; give more of it")
        return Task.model_validate_json(rows[0][0])

    def mark_interrupted(self, locks: RunLocks) -> list[str]:
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
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, request, state, json_extract(body, '$.device'), json_extract(body, '$.requested_by'), "
                "created_at, updated_at FROM tasks "
                "WHERE CAST(? AS TEXT) IS NULL OR state = ? ORDER BY updated_at DESC LIMIT ?",
                (state, state, limit)).fetchall()
        keys = ("id", "request", "state", "device", "requested_by", "created_at", "updated_at")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def ids(self) -> builtins.list[str]:
        """Every task's id (each is the undo session of the task's commands)."""
        with self._lock:
            return [row[0] for row in self._conn.execute("SELECT id FROM tasks")]

    def unfinished(self) -> builtins.list[Task]:
        """Tasks not done, failed or cancelled: what a restarted server must resume or settle."""
        ended = (*(s.value for s in TERMINAL_STATES), TaskState.INTERRUPTED.value)
        with self._lock:
            rows = self._conn.execute("SELECT body FROM tasks WHERE state NOT IN (?, ?, ?, ?) ORDER BY created_at",
                                      ended).fetchall()
        return [Task.model_validate_json(row[0]) for row in rows]


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
    """

    retry_s = 1.0

    def __init__(self, store: TaskStore) -> None:
        self.store = store
        self._dirty: dict[str, Task] = {}
        self.unsaved: dict[str, Task] = {}
        self.problem: str | None = None  # why the last save failed; None once everything is saved
        self._retry: asyncio.TimerHandle | None = None

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
        """Write what is waiting and what failed before; None when all of it is saved, else why not."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        dirty, self._dirty = {**self.unsaved, **self._dirty}, {}
        problem = None
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
        if problem is None and self.problem is not None:
            logger.warning("tasks can be saved again")
        self.problem = problem
        if self.unsaved:
            try:
                self._retry = asyncio.get_running_loop().call_later(self.retry_s, self.flush)
            except RuntimeError:
                pass  # no loop (closing): the caller reports what stays unsaved
        return problem

    def forget(self, task_id: str) -> None:
        """Drop a task that was never created (its first save failed and the caller was told)."""
        self.unsaved.pop(task_id, None)
        self._dirty.pop(task_id, None)

    def cancel(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
