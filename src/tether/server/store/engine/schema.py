"""Schema changes one process at a time: the schema lock, and `CREATE … IF NOT EXISTS` scripts under it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tether.server.store.engine.names import dialect_of
from tether.server.store.engine.sql import split_script

SCHEMA_LOCK_KEY = 0x7465_7468_6572_5343  # "tetherSC": the advisory lock every schema change of tether's runs under


@contextlib.contextmanager
def schema_transaction(conn: Any) -> Iterator[None]:
    """One transaction that holds the database's schema lock: schema creation and migrations inside it run
    one process at a time, so any number of servers can start at once on a fresh database (concurrent
    `CREATE TABLE IF NOT EXISTS` race on PostgreSQL's catalog otherwise). SQLite: `BEGIN IMMEDIATE` (the
    write lock, waited for up to the connection's busy timeout). PostgreSQL: `pg_advisory_xact_lock`, released
    with the transaction. Commits on success, rolls back on any error."""
    if dialect_of(conn) == "postgres":
        conn.execute("BEGIN")
        conn.execute(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK_KEY})")
    else:
        conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with contextlib.suppress(Exception):  # a lost connection has no transaction left to end
                conn.execute("ROLLBACK")
        raise


def create_schema(conn: Any, script: str) -> None:
    """Run a `CREATE … IF NOT EXISTS` script so that processes starting at once cannot race on it: on
    PostgreSQL under the schema lock (`schema_transaction`); SQLite checks existence under its write lock
    already, and a script whose tables exist writes nothing (a read-only state directory still opens)."""
    if dialect_of(conn) != "postgres":
        conn.executescript(script)
        return
    with schema_transaction(conn):
        for statement in split_script(script):
            conn.execute(statement)
