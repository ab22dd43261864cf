"""`Store`: the agent server's durable state in one database — SQLite file or PostgreSQL — as tables.

`Store(path)` opens the database (`engine.Engine`), brings its schema up to date (`migrations`) and
holds one object per table: `store.tokens` (`tokens.Tokens`), `store.devices` (`devices.Devices`),
`store.device_keys` (`devices.DeviceKeys`), `store.sessions` (`sessions.Sessions`), `store.audit`
(`audit.AuditLog`), `store.pairing` (`pairing.Pairing`) and `store.webhooks` (`webhooks.Webhooks`).
Every statement is written inside this package: callers use the tables' methods, never SQL. SQLite: one
connection in WAL mode, guarded by a lock so the few callers that move work to a thread stay safe; every
call is a short statement, cheap enough to run on the event loop. PostgreSQL: each thread has a session of
its own (`pool.ThreadConnections`) and callers on the event loop run the tables' methods on `calls`, a small
bounded pool (`await store.call(fn, *args)`), so a lock or a stalled database holds only the requests that
need it; the audit log runs apart, on the engine's worker thread and a session of its own
(docs/database.md). The tasks live apart, on a connection of their own (`tasks.TaskTable`).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tether.server.store.audit import AuditLog
from tether.server.store.devices import DeviceKeys, Devices
from tether.server.store.engine import Engine, StoreUnavailable, free_space_problem
from tether.server.store.migrations import migrate, schema_version
from tether.server.store.pairing import Pairing
from tether.server.store.pool import StatementPool, ThreadConnections
from tether.server.store.sessions import Sessions
from tether.server.store.tokens import Tokens
from tether.server.store.webhooks import Webhooks

__all__ = ["Store", "StoreUnavailable", "check_state_dir"]

T = TypeVar("T")


class Store:
    """The server's database and its tables (see the module's docstring)."""

    def __init__(self, path: str | Path) -> None:
        """Open (or create) the database at `path` (a file, `:memory:` or a `postgresql://` URL) and migrate
        it; `StoreUnavailable` says in one line when its directory cannot be written (full, read-only, no
        permission) or the database cannot be reached. RuntimeError when its schema is newer than this
        tether's."""
        engine = Engine(path, sessions=ThreadConnections)
        try:
            with engine.lock:
                migrate(engine)
        except (sqlite3.Error, OSError) as exc:
            engine.fail(exc)
        self._engine = engine
        self.where = engine.where  # for messages: a URL's password masked
        self.path = engine.path
        self.dialect = engine.dialect
        # PostgreSQL: where the tables' statements run for callers on the event loop; None: at once (SQLite)
        self.calls = StatementPool() if engine.dialect == "postgres" else None
        self.tokens = Tokens(engine, self.calls)
        self.devices = Devices(engine)
        self.device_keys = DeviceKeys(engine, self.tokens)
        self.sessions = Sessions(engine)
        self.audit = AuditLog(engine)
        self.pairing = Pairing(engine, self.tokens)
        self.webhooks = Webhooks(engine)

    async def call(self, fn: Callable[..., T], *args: Any, in_order: bool = False) -> T:
        """`fn(*args)` — a table's method — without holding up the event loop: with PostgreSQL on `calls`
        (`StoreUnavailable` when the database has not answered within `pool.CALL_TIMEOUT_S`; `in_order`: after
        every write `soon` was given), with SQLite at once, on this thread (a local statement costs less than
        handing it to a thread)."""
        if self.calls is None:
            return fn(*args)
        return await self.calls.call(fn, *args, in_order=in_order)

    def soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` — a table's write nobody waits for — behind the caller: with PostgreSQL on `calls` (its
        error logged), with SQLite at once (its error raised)."""
        if self.calls is None:
            fn(*args)
        else:
            self.calls.submit(fn, *args)

    def stalled(self) -> str | None:
        """One line when a statement of the tables has waited past `pool.STALL_S` for the database, else None
        (always None with SQLite, whose statements run at once). From state: no statement runs."""
        return self.calls.stalled() if self.calls is not None else None

    def check_writable(self) -> None:
        """Raise `StoreUnavailable` (one line) unless the database can be written and its disk has room:
        what a server checks before it starts."""
        engine = self._engine
        if engine.memory:
            if engine.dialect == "postgres":  # reachable and writable: one empty transaction
                with engine.writing(), engine.lock:
                    engine.conn.execute("BEGIN")
                    engine.conn.execute("ROLLBACK")
            return
        problem = free_space_problem(engine.path.parent)
        if problem is not None:
            raise StoreUnavailable(problem)
        with engine.writing(), engine.lock:
            engine.conn.execute("BEGIN IMMEDIATE")
            engine.conn.execute("ROLLBACK")

    @property
    def schema_version(self) -> int:
        """The database's schema version (how many migrations it has)."""
        return schema_version(self._engine)

    def close(self) -> None:
        """Write the audit rows held back (logging those that cannot be), then close the connection."""
        self.audit.close()
        if self.calls is not None:
            self.calls.close()
        self._engine.close()


def check_state_dir(db_path: str | Path) -> None:
    """Raise `StoreUnavailable` (one line) unless the server's database at `db_path` opens, can be
    written and has room beside it: a server checks this before it starts."""
    store = Store(db_path)
    try:
        store.check_writable()
    finally:
        with contextlib.suppress(sqlite3.Error):
            store.close()
