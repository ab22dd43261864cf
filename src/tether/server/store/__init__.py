"""`Store`: the agent server's durable state in one database — SQLite file or PostgreSQL — as tables.

`Store(path)` opens the database (`engine.Engine`), brings its schema up to date (`migrations`) and
holds one object per table: `store.tokens` (`tokens.Tokens`), `store.devices` (`devices.Devices`),
`store.device_keys` (`devices.DeviceKeys`), `store.sessions` (`sessions.Sessions`), `store.audit`
(`audit.AuditLog`), `store.pairing` (`pairing.Pairing`) and `store.webhooks` (`webhooks.Webhooks`).
Every statement is written inside this package: callers use the tables' methods, never SQL. One
connection in WAL mode, guarded by a lock so the few callers that move work to a thread stay safe; every
call is a short statement, cheap enough to run on the event loop. The tasks live apart, on a connection of their own
(`tasks.TaskTable`).
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from tether.server.store.audit import AuditLog
from tether.server.store.devices import DeviceKeys, Devices
from tether.server.store.engine import Engine, StoreUnavailable, free_space_problem
from tether.server.store.migrations import migrate, schema_version
from tether.server.store.pairing import Pairing
from tether.server.store.sessions import Sessions
from tether.server.store.tokens import Tokens
from tether.server.store.webhooks import Webhooks

__all__ = ["Store", "StoreUnavailable", "check_state_dir"]


class Store:
    """The server's database and its tables (see the module's docstring)."""

    def __init__(self, path: str | Path) -> None:
        """Open (or create) the database at `path` (a file, `:memory:` or a `postgresql://` URL) and migrate
        it; `StoreUnavailable` says in one line when its directory cannot be written (full, read-only, no
        permission) or the database cannot be reached. RuntimeError when its schema is newer than this
        tether's."""
        engine = Engine(path)
        try:
            with engine.lock:
                migrate(engine)
        except (sqlite3.Error, OSError) as exc:
            engine.fail(exc)
        self._engine = engine
        self.where = engine.where  # for messages: a URL's password masked
        self.path = engine.path
        self.dialect = engine.dialect
        self.tokens = Tokens(engine)
        self.devices = Devices(engine)
        self.device_keys = DeviceKeys(engine, self.tokens)
        self.sessions = Sessions(engine)
        self.audit = AuditLog(engine)
        self.pairing = Pairing(engine, self.tokens)
        self.webhooks = Webhooks(engine)

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
