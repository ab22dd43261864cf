"""`PostgresConnection`: psycopg 3 behind `sqlite3.Connection`'s surface, and the token-change listener."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from tether.server.store.engine.names import (
    CONNECT_TIMEOUT_S,
    STATEMENT_TIMEOUT_MS,
    TOKENS_CHANNEL,
    Dialect,
    StoreUnavailable,
    safe_url,
)
from tether.server.store.engine.sql import split_script, to_postgres

logger = logging.getLogger(__package__)


class Row(tuple[Any, ...]):
    """A result row read by index or by column name, as `sqlite3.Row`."""

    _names: Mapping[str, int]

    def __new__(cls, values: Sequence[Any], names: Mapping[str, int]) -> Row:
        row = super().__new__(cls, values)
        row._names = names
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._names[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._names)


class _Cursor:
    def __init__(self, rows: list[Row], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def fetchone(self) -> Row | None:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Row]:
        return self._rows

    def __iter__(self) -> Iterator[Row]:
        return iter(self._rows)


class PostgresConnection:
    """A psycopg 3 connection with `sqlite3.Connection`'s surface (see the module docstring).

    Autocommit like the stores' SQLite connections (`isolation_level=None`): a statement outside an
    explicit `BEGIN` commits on its own. A connection lost to a restart or a network cut is reopened on
    the next statement; the statement that met the loss raises `StoreUnavailable`.
    """

    dialect: Dialect = "postgres"

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.RLock()
        self._conn = self._connect()
        self._tokens = TokenListener(url)

    def _connect(self) -> Any:
        try:
            import psycopg
        except ImportError:
            raise StoreUnavailable("a postgresql:// database needs psycopg: pip install 'tether[cluster]'") from None
        try:
            # keepalives: a session to a database gone silent (a cut network) fails within ~25 s instead of
            # holding its thread until the kernel gives up on the connection
            return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                                   options=f"-c statement_timeout={STATEMENT_TIMEOUT_MS}", keepalives=1,
                                   keepalives_idle=10, keepalives_interval=5, keepalives_count=3)
        except psycopg.Error as exc:
            raise StoreUnavailable(f"cannot reach the database {safe_url(self.url)}: {_first_line(exc)}") from None

    # -- the sqlite3.Connection surface -------------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        from psycopg.pq import TransactionStatus

        return self._conn.info.transaction_status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> _Cursor:
        return self._run(sql, params, many=False)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> _Cursor:
        return self._run(sql, list(rows), many=True)

    def executescript(self, script: str) -> None:
        for statement in split_script(script):
            self.execute(statement)

    def execute_together(self, steps: Sequence[tuple[str, Sequence[Sequence[Any]]]]) -> None:
        """Several statements, each run once per row of its parameters, in ONE round trip to
        the database and ONE transaction: psycopg's pipeline mode outside an explicit `BEGIN`, where everything
        up to the pipeline's single Sync is one implicit transaction — all of it is written, or none of it
        (steps may also open and end an explicit transaction themselves). A step with no rows is left out.
        Errors as `execute`'s (the `sqlite3` classes, `StoreUnavailable`)."""
        import psycopg

        steps = [(to_postgres(sql), [_no_nul(row) for row in rows]) for sql, rows in steps if rows]
        if not steps:
            return
        with self._lock:
            if self._conn.closed or self._conn.broken:
                self._conn = self._connect()
            try:
                with self._conn.pipeline():
                    cur = self._conn.cursor()
                    for text, rows in steps:
                        for row in rows:  # not prepared: a failed pipeline leaves psycopg's cache of them wrong
                            cur.execute(text, row, prepare=False)
            except psycopg.Error as exc:
                raise _as_sqlite_error(exc, self.url, broken=self._conn.broken or self._conn.closed) from None

    def close(self) -> None:
        with self._lock, contextlib.suppress(Exception):
            self._conn.close()
        self._tokens.close()

    def _run(self, sql: str, params: Any, *, many: bool) -> _Cursor:
        import psycopg

        text = to_postgres(sql)
        params = [_no_nul(row) for row in params] if many else _no_nul(params)
        with self._lock:
            if self._conn.closed or self._conn.broken:
                self._conn = self._connect()
            try:
                cur = self._conn.cursor()
                if many:
                    cur.executemany(text, params)
                else:
                    cur.execute(text, params)  # always with params: `%%` is read as `%` only then
                rows: list[Row] = []
                if cur.description is not None:
                    names = {d.name: i for i, d in enumerate(cur.description)}
                    rows = [Row(r, names) for r in cur.fetchall()]
                return _Cursor(rows, cur.rowcount)
            except psycopg.Error as exc:
                raise _as_sqlite_error(exc, self.url, broken=self._conn.broken or self._conn.closed) from None

    # -- token changes made by other processes ----------------------------------------------------

    def data_version(self, *, connect: bool = True) -> int:
        """`TokenListener.version` of this connection's own listener session (see there)."""
        return self._tokens.version(connect=connect)


class TokenListener:
    """Token changes made by other server processes, seen on a PostgreSQL session of its own that LISTENs
    on `TOKENS_CHANNEL`. Thread-safe; `close` closes the session (a later `version` opens a new one)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: Any = None
        self._lock = threading.Lock()
        self._version = 0

    def version(self, *, connect: bool = True) -> int:
        """A number that moves when another server process changed the tokens (SQLite's
        `PRAGMA data_version`): the count of `tether_tokens` notifications seen, read without waiting for
        the database. Without a working listener it moves on every call, so nothing stale is trusted; the
        listener is (re)opened only with `connect` (off the event loop: opening one waits for the network)."""
        import psycopg

        with self._lock:
            try:
                listener = self._conn
                if listener is None or listener.closed or listener.broken:
                    self._conn = None
                    self._version += 1
                    if not connect:
                        return self._version
                    listener = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
                    listener.execute(f"LISTEN {TOKENS_CHANNEL}")
                    self._conn = listener
                pg = listener.pgconn
                pg.consume_input()
                while pg.notifies() is not None:
                    self._version += 1
            except psycopg.Error as exc:
                logger.debug("token change listener: %s", _first_line(exc))
                with contextlib.suppress(Exception):
                    if self._conn is not None:
                        self._conn.close()
                self._conn = None
                self._version += 1
            return self._version

    def close(self) -> None:
        """Close the listener session (a later `version` opens a new one, with `connect`)."""
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
                self._conn = None


def _no_nul(params: Any) -> Any:
    """PostgreSQL's text cannot hold NUL, which SQLite's can: a NUL in a value (a session name an attacker
    chose, a command's argument in the audit log) becomes U+FFFD instead of failing the statement — a
    failing audit row is held and retried, and while it is held no command runs."""
    if isinstance(params, Mapping):
        return {k: v.replace("\x00", "\ufffd") if isinstance(v, str) else v for k, v in params.items()}
    if isinstance(params, (tuple, list)):
        return [v.replace("\x00", "\ufffd") if isinstance(v, str) else v for v in params]
    return params


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _as_sqlite_error(exc: Exception, url: str, *, broken: bool) -> Exception:
    import psycopg

    if broken or (isinstance(exc, psycopg.OperationalError) and not isinstance(exc, psycopg.errors.QueryCanceled)):
        return StoreUnavailable(f"database unavailable ({safe_url(url)}): {_first_line(exc)}")
    if isinstance(exc, psycopg.IntegrityError):
        return sqlite3.IntegrityError(_first_line(exc))
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return sqlite3.OperationalError(f"statement timed out: {_first_line(exc)}")
    return sqlite3.DatabaseError(_first_line(exc))


def open_postgres(url: str) -> PostgresConnection:
    return PostgresConnection(url)
