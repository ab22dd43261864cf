"""The `tasks` table (each task stored whole as its JSON) and the `task_leases` table (which server node
runs each unfinished task), on a connection of their own: the agent's task store (`tether.agent.tasks.store`)
and its task leases (`tether.agent.tasks.cluster.ownership`) run their statements here.

A task is small and always read whole (its log is its record), so a row per task with the serialized
task is simpler than a table per part and keeps every field the executor adds.

With PostgreSQL the table's statements for callers on the event loop run on ONE worker thread of the table's
(`offload`, `submit`, `call`), in the order they were given: a lock on the table or a stalled database holds
that thread and the callers awaiting it, never the loop. With SQLite they run at once.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tether.server.store.engine import StoreUnavailable, create_schema, describe, disk_problem, is_url, open_postgres

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

LEASE_SCHEMA = """
CREATE TABLE IF NOT EXISTS task_leases (
    task_id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    expires_at REAL NOT NULL
)
"""
T = TypeVar("T")
CALL_TIMEOUT_S = 35.0  # a caller on the event loop waits this long for the table (statements: 30 s)
STALL_S = 2.0  # work given to the worker and not done after this long makes `stalled()` say so
_ORPHANED = ("SELECT t.id FROM tasks t LEFT JOIN task_leases l ON l.task_id = t.id WHERE t.state NOT IN (?, ?, ?, ?) "
             "AND (l.task_id IS NULL OR l.expires_at < ?) ORDER BY t.created_at")


class TaskTable:
    """The `tasks` table in a SQLite file, or in the server's PostgreSQL database (a `postgresql://` URL).

    `StoreUnavailable` (one line) when the file cannot be opened or written, or the database cannot be
    reached; other `sqlite3` errors pass through.
    """

    def __init__(self, path: str | Path) -> None:
        self.where = describe(path)
        self._lock = threading.Lock()
        self._conn: Any  # a sqlite3.Connection, or a PostgresConnection with its surface
        self.offload = is_url(path)  # PostgreSQL: loop callers' statements run on `_worker`
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-tasks") if self.offload else None
        self._waiting: dict[int, float] = {}  # work on the worker not done yet: number -> since
        self._numbers = itertools.count()
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

    def close(self) -> None:
        """Run what the worker was given, then close the connection."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        with self._lock:
            self._conn.close()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` (this table's statements) after everything given before it: on the worker with PostgreSQL,
        at once otherwise (the future is then done on return). RuntimeError once closed."""
        if self._worker is None:
            done: Future[T] = Future()
            try:
                done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)
            return done
        return self._tracked(self._worker.submit(fn))

    def _tracked(self, future: Future[T]) -> Future[T]:
        number = next(self._numbers)
        self._waiting[number] = time.monotonic()
        future.add_done_callback(lambda _: self._waiting.pop(number, None))
        return future

    def stalled(self) -> str | None:
        """One line when work given to the worker has waited longer than `STALL_S` for the database (a lock
        on the table, a slow or lost database), else None. From state: no statement runs."""
        since = min(tuple(self._waiting.values()), default=None)
        if since is None or time.monotonic() - since <= STALL_S:
            return None
        return (f"the tasks table has not answered for {time.monotonic() - since:.1f}s (a lock on it, a slow or "
                f"lost database); {len(self._waiting)} waiting")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` without holding up the event loop (`submit`); its result or error. `StoreUnavailable`
        when the database has not answered within `CALL_TIMEOUT_S`."""
        if self._worker is None:
            return fn(*args)
        try:
            future = self._tracked(self._worker.submit(fn, *args))
        except RuntimeError:
            raise StoreUnavailable(f"the task store {self.where} is closed") from None
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
        except TimeoutError:
            raise StoreUnavailable(f"the task store {self.where} did not answer within {CALL_TIMEOUT_S:g}s") from None

    def save(self, task_id: str, request: str, state: str, created_at: str, updated_at: str, body: str) -> None:
        """Store a task's row whole (a new one, or its state, update time and body); `StoreUnavailable`
        when the disk is full or read-only."""
        row = (task_id, request, state, created_at, updated_at, body)
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

    def bodies(self, task_id: str) -> list[str]:
        """The body of the task with this id; else those of at most two tasks whose id starts with it
        (LIKE's wildcards taken out of it), so a caller tells none, one and several apart."""
        prefix = task_id.replace("%", "").replace("_", "")
        with self._lock:
            exact = self._conn.execute("SELECT body FROM tasks WHERE id = ?", (task_id,)).fetchone()
            rows = [exact] if exact else self._conn.execute(
                "SELECT body FROM tasks WHERE id LIKE ? LIMIT 2", (prefix + "%",)).fetchall() if prefix else []
        return [row[0] for row in rows]

    def rows(self, limit: int, state: str | None) -> list[dict[str, Any]]:
        """Newest first; each row is id, request, state, device, requested_by, created_at, updated_at."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, request, state, json_extract(body, '$.device'), json_extract(body, '$.requested_by'), "
                "created_at, updated_at FROM tasks "
                "WHERE CAST(? AS TEXT) IS NULL OR state = ? ORDER BY updated_at DESC LIMIT ?",
                (state, state, limit)).fetchall()
        keys = ("id", "request", "state", "device", "requested_by", "created_at", "updated_at")
        return [dict(zip(keys, row, strict=True)) for row in rows]

    def ids(self) -> list[str]:
        """Every task's id."""
        with self._lock:
            return [row[0] for row in self._conn.execute("SELECT id FROM tasks")]

    def bodies_not_in(self, ended: Iterable[str]) -> list[str]:
        """The bodies of the tasks whose state is none of the four `ended`, oldest first."""
        with self._lock:
            rows = self._conn.execute("SELECT body FROM tasks WHERE state NOT IN (?, ?, ?, ?) ORDER BY created_at",
                                      tuple(ended)).fetchall()
        return [row[0] for row in rows]

    # -- task leases (tether.agent.tasks.cluster.ownership) ------------------------------------------------------

    def create_leases(self) -> None:
        """Create the `task_leases` table on this connection, if it is not there."""
        with self._lock:
            create_schema(self._conn, LEASE_SCHEMA)

    def claim_lease(self, task_id: str, node: str, until: float, now: float) -> bool:
        """Lease the task to `node` until `until` unless another node holds it past `now`; True when `node`
        holds it now."""
        return self._write(
            "INSERT INTO task_leases (task_id, node, expires_at) VALUES (?, ?, ?) "
            "ON CONFLICT (task_id) DO UPDATE SET node = excluded.node, expires_at = excluded.expires_at "
            "WHERE task_leases.node = excluded.node OR task_leases.expires_at < ?",
            (task_id, node, until, now)) > 0

    def lease(self, task_id: str) -> tuple[str, float] | None:
        """(node, expires_at) of the task's lease, or None."""
        with self._lock:
            rows = self._conn.execute("SELECT node, expires_at FROM task_leases WHERE task_id = ?",
                                      (task_id,)).fetchall()
        return (rows[0][0], rows[0][1]) if rows else None

    def extend_lease(self, task_id: str, node: str, until: float) -> bool:
        """Extend `node`'s lease of the task to `until`; False when `node` holds no lease of it."""
        return self._write("UPDATE task_leases SET expires_at = ? WHERE task_id = ? AND node = ?",
                           (until, task_id, node)) != 0

    def release_lease(self, task_id: str, node: str) -> None:
        self._write("DELETE FROM task_leases WHERE task_id = ? AND node = ?", (task_id, node))

    def orphaned(self, ended: Iterable[str], now: float) -> list[str]:
        """Ids of the tasks in none of the four `ended` states that nobody holds at `now`: oldest first."""
        with self._lock:
            rows = self._conn.execute(_ORPHANED, (*ended, now)).fetchall()
        return [row[0] for row in rows]

    def _write(self, sql: str, params: tuple[Any, ...]) -> int:
        """One writing statement; the rows it changed. `StoreUnavailable` when the disk or database is gone."""
        try:
            with self._lock:
                return self._conn.execute(sql, params).rowcount
        except sqlite3.Error as exc:
            problem = disk_problem(exc, self.path)
            if problem is None:
                raise
            raise StoreUnavailable(problem) from None
