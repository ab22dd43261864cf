"""The Store's statements off the event loop, with PostgreSQL: a small bounded pool of threads, each with a
PostgreSQL session of its own.

`ThreadConnections` offers the one connection surface the tables are written against (`execute`,
`executemany`, `executescript`, `in_transaction`, `close`) and runs each call on the calling thread's own
session (`PostgresConnection`, opened on its first statement), so a statement waiting for a lock on one
table holds only its own thread: the other threads' statements, on other tables, go on. It also reads the
token-change notifications (`data_version`) on a listener session of its own.

`StatementPool` is where the tables' statements run: `await pool.call(fn, *args)` runs `fn` on one of
`POOL_SIZE` threads and waits for it at most `CALL_TIMEOUT_S` (`StoreUnavailable` after that; the event loop
never waits); `pool.submit(fn, *args)` runs a write nobody waits for on one more thread, in order.
`stalled()` says, from state, when a statement has been waiting longer than `STALL_S` (what `/health`
reports as `degraded`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tether.server.store.engine import (
    Dialect,
    PostgresConnection,
    StoreUnavailable,
    TokenListener,
    _first_line,
    split_script,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
POOL_SIZE = 8  # threads (and PostgreSQL sessions) running the tables' statements, per Store
CALL_TIMEOUT_S = 35.0  # a caller waits this long for its statement (statements themselves: 30 s)
STALL_S = 2.0  # a statement waiting longer than this makes `stalled()` (and /health) say so


class ThreadConnections:
    """One PostgreSQL session per thread behind one `sqlite3.Connection`-like surface (the module's
    docstring). The session of the thread that constructs it is opened at once, so an unreachable database
    is `StoreUnavailable` (one line) there; the others open on their thread's first statement."""

    dialect: Dialect = "postgres"

    def __init__(self, url: str) -> None:
        self.url = url
        self._local = threading.local()
        self._sessions: list[PostgresConnection] = []
        self._sessions_lock = threading.Lock()
        self._tokens = TokenListener(url)
        self._mine()

    def _mine(self) -> PostgresConnection:
        conn: PostgresConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = PostgresConnection(self.url)
            self._local.conn = conn
            with self._sessions_lock:
                self._sessions.append(conn)
        return conn

    @property
    def in_transaction(self) -> bool:
        """Whether the calling thread's session is inside a transaction."""
        return self._mine().in_transaction

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> Any:
        """Run one statement on the calling thread's session (`sqlite3.Connection.execute`'s contract)."""
        return self._mine().execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> Any:
        """Run one statement once per row on the calling thread's session."""
        return self._mine().executemany(sql, rows)

    def executescript(self, script: str) -> None:
        """Run each statement of `script` in turn on the calling thread's session."""
        for statement in split_script(script):
            self.execute(statement)

    def close(self) -> None:
        """Close every thread's session and the token-change listener."""
        with self._sessions_lock:
            sessions, self._sessions = self._sessions, []
        for conn in sessions:
            conn.close()
        self._tokens.close()

    def data_version(self, *, connect: bool = True) -> int:
        """`TokenListener.version` of the token-change listener these sessions share (see there)."""
        return self._tokens.version(connect=connect)


class StatementPool:
    """`POOL_SIZE` threads that run the tables' statements (see the module's docstring)."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        self._executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="tether-db")
        # the writes nobody waits for, one at a time in the order given (a device's rows stay in order)
        self._behind = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tether-db-behind")
        self._waiting: dict[int, tuple[float, str]] = {}  # call number -> (since, what), on the loop only
        self._numbers = itertools.count()

    async def call(self, fn: Callable[..., T], *args: Any, in_order: bool = False) -> T:
        """`fn(*args)` on one of the pool's threads (`in_order`: on the thread of `submit`, after the writes
        given to it before); its result or error. `StoreUnavailable` when it has not answered within
        `CALL_TIMEOUT_S` (the thread goes on until the statement's own timeout), when the statement itself timed
        out (a lock held past `statement_timeout`), or when the pool is closed. Only the awaiting caller waits:
        the event loop goes on."""
        try:
            future = (self._behind if in_order else self._executor).submit(fn, *args)
        except RuntimeError:
            raise StoreUnavailable("the database is closed (the server is stopping)") from None
        number = next(self._numbers)
        self._waiting[number] = (time.monotonic(), getattr(fn, "__qualname__", "a statement"))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)
        except TimeoutError:
            raise StoreUnavailable(f"the database did not answer within {CALL_TIMEOUT_S:g}s") from None
        except sqlite3.OperationalError as exc:  # the statement's own timeout (a lock held past it): unavailable
            if str(exc).startswith("statement timed out"):
                raise StoreUnavailable(f"the database did not answer: {exc}") from None
            raise
        finally:
            del self._waiting[number]

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` on the pool's thread for writes nobody waits for, after those given before it; its error
        is logged. Nothing once the pool is closed."""
        def run() -> None:
            try:
                fn(*args)
            except Exception as exc:
                logger.warning("a background database write failed: %s", _first_line(exc))

        with contextlib.suppress(RuntimeError):
            self._behind.submit(run)

    def stalled(self) -> str | None:
        """One line when a statement has waited longer than `STALL_S` for the database (a lock on its table, a
        slow or lost database), else None. From state: no statement runs."""
        if not self._waiting:
            return None
        since, what = min(self._waiting.values())
        waited = time.monotonic() - since
        if waited <= STALL_S:
            return None
        return (f"a database statement ({what}) has waited {waited:.1f}s (a lock on its table, a slow or lost "
                f"database); {len(self._waiting)} waiting")

    def close(self) -> None:
        """Run what was given, then stop the threads."""
        self._behind.shutdown(wait=True)
        self._executor.shutdown(wait=True)
