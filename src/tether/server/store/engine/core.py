"""`Engine`: the server's open database that every table of the `Store` runs its statements on."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

from tether.server.store.engine.disk import disk_problem
from tether.server.store.engine.names import StoreUnavailable, describe, dialect_of, is_url
from tether.server.store.engine.postgres import open_postgres

T = TypeVar("T")


class Ran(Generic[T]):
    """What a function run at once gave (`Engine.submit` without `offload`): `result()` returns its value or
    raises its error, as a `Future`'s would; `done()` is True. Lighter than a `Future`, which takes a lock."""

    __slots__ = ("_error", "_value")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._error: BaseException | None = None
        try:
            self._value: T | None = fn()
        except BaseException as exc:  # the caller reads it from `result()`, as from a worker's future
            self._error, self._value = exc, None

    def done(self) -> bool:
        return True

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class NoLock:
    """A lock that is never held: where each thread has a database session of its own (`Engine(sessions=…)`)
    there is nothing to guard between threads."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Engine:
    """The server's open database — the SQLite file (WAL) or PostgreSQL — that every table of the `Store`
    runs its statements on: one connection, one lock that each statement holds, and the error rules.

    `Engine(path)` opens (or creates) the database at `path` (a file path, `:memory:`, or a
    `postgresql://` URL); `StoreUnavailable` says in one line when it cannot (full, read-only, no
    permission, unreachable). The tables use `conn` under `lock`; nothing outside `tether.server.store`
    holds an engine.

    With PostgreSQL (`offload`) the audit log's statements run apart, on `worker` — ONE thread per engine,
    so they run in the order they were submitted — with a session of their own, `audit_conn` under
    `audit_lock`: a lock, a slow network or a lost backend holds that thread, never the event loop. With
    SQLite a commit costs less than handing it to a thread (waking it and taking the GIL back), and only
    this process writes the file (`lease`), so there `submit` runs the
    function at once and `audit_conn`, `audit_lock` are `conn`, `lock`. `submit` hands the worker a
    function; `run_sync` waits for one. `close` stops the worker after what it was given and closes both.
    """

    def __init__(self, path: str | Path, *, sessions: Callable[[str], Any] | None = None) -> None:
        self.where = describe(path)  # for messages: a URL's password masked
        self.path = Path(self.where)
        self.directory = str(self.path.parent)
        # `sessions`: opens the connection for a postgresql:// URL with a session per thread, where the tables'
        # statements then run without a lock between threads (`tether.server.store.pool.ThreadConnections`)
        threaded = sessions is not None and is_url(path)
        self.lock: Any = NoLock() if threaded else threading.Lock()
        # nothing on this machine's disk to check for a database elsewhere (PostgreSQL) or in memory
        self.memory = str(path) == ":memory:" or is_url(path)
        self.conn: Any
        self.audit_conn: Any = None
        self.audit_lock = self.lock
        self.offload = is_url(path)  # PostgreSQL: the audit log's statements run on `worker`
        try:
            if is_url(path):
                self.conn = sessions(str(path)) if sessions is not None else open_postgres(str(path))
            else:
                if not self.memory:
                    self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                self.conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
                self.conn.row_factory = sqlite3.Row
                if not self.memory:
                    self.path.chmod(0o600)
            self.dialect = dialect_of(self.conn)
            with self.lock:
                if self.dialect == "sqlite":
                    self.conn.execute("PRAGMA journal_mode=WAL")
                    self.conn.execute("PRAGMA synchronous=NORMAL")
                    self.conn.execute("PRAGMA foreign_keys=ON")
            self.audit_conn = self._open_audit_connection(path)
        except (sqlite3.Error, OSError) as exc:
            self.fail(exc)
        if self.audit_conn is not self.conn or threaded:
            self.audit_lock = threading.Lock()
        self._worker_thread: int | None = None
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-store",
                                         initializer=self._note_worker)

    def _open_audit_connection(self, path: str | Path) -> Any:
        """The audit log's own connection (see the class docstring)."""
        return open_postgres(str(path)) if self.offload else self.conn

    def _note_worker(self) -> None:
        self._worker_thread = threading.get_ident()

    def submit(self, fn: Callable[[], T]) -> Future[T] | Ran[T]:
        """Run `fn` on the worker after everything submitted before it; its future. Without `offload`
        `fn` runs now, on this thread, and the future is done on return. RuntimeError once closed."""
        if not self.offload:
            return Ran(fn)
        return self.worker.submit(fn)

    def run_sync(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the worker (after everything submitted before it) and wait for its result or error;
        on the worker itself, or once the worker is stopped, it runs at once. The wait is bounded by the
        statements' own timeouts (`STATEMENT_TIMEOUT_MS`, SQLite's busy timeout)."""
        if not self.offload or threading.get_ident() == self._worker_thread:
            return fn()
        try:
            future = self.worker.submit(fn)
        except RuntimeError:  # closed: nothing else can be running on the audit connection
            return fn()
        return future.result()

    def fail(self, exc: BaseException) -> None:
        """Close the connection after `exc` met while opening the database, and raise `StoreUnavailable`
        saying why in one line."""
        for conn in (getattr(self, "audit_conn", None), getattr(self, "conn", None)):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        raise StoreUnavailable(disk_problem(exc, self.path) or f"cannot open {self.where}: {exc}") from None

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """A write whose failure for lack of a writable disk becomes `StoreUnavailable`."""
        try:
            yield
        except sqlite3.Error as exc:
            problem = disk_problem(exc, self.path)
            if problem is None:
                raise
            raise StoreUnavailable(problem) from None

    def rollback(self, conn: Any = None) -> None:
        """Roll back the open transaction of `conn` (default: `self.conn`), if SQLite has not already (it
        does after a full disk)."""
        conn = self.conn if conn is None else conn
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    def read(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        """The rows of one reading statement, under the lock."""
        with self.lock:
            return self.conn.execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        """Stop the worker once what it was given has run, then close the connections."""
        self.worker.shutdown(wait=True)
        with self.lock:
            if self.audit_conn is not None and self.audit_conn is not self.conn:
                with contextlib.suppress(Exception):
                    self.audit_conn.close()
            self.conn.close()
