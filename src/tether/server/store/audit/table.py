"""`AuditTable`: the `audit` table's rows and the SQL that writes them — the base of `AuditLog`.

It holds the state every part of the log shares (the held rows and outcomes, the group being built, the probe's
findings), the statements that insert rows and settle outcomes, and how a piece of work reaches the database:
on the engine's worker thread with PostgreSQL (`Engine.offload`), at once on the caller's thread with SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from tether.server.store.engine import Engine, Ran, T

_MAX_ARGUMENTS_CHARS = 16_384

# requested_by, device, call_id, tool_name, arguments, status, error, response_id[, approved_by[, approval_digest]]
AuditRow = tuple[Any, ...]
# what a write on the worker gave: (rows not written, outcomes not written, the error that stopped them)
_PartsDone = tuple[list[Any], list[Any], BaseException | None]
_GroupDone = tuple[str | None, list[Any], list[Any], BaseException | None]  # (why `sent` failed, *_PartsDone)

SENT, UNKNOWN, PENDING = "sent", "unknown", "pending"
LATE_NOTE = "late: this outcome came back after the caller's wait had ended"


class AuditTable:
    """The state and the statements of the `audit` table that `AuditLog`'s parts share (see the module's
    docstring); not used on its own."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn, self._lock, self._writing = engine.audit_conn, engine.audit_lock, engine.writing
        self._dialect = engine.dialect
        self._memory = engine.memory
        self._directory = engine.directory
        self.path, self.where = engine.path, engine.where
        self._free_space_turn: tuple[str | None] | None = None  # this loop turn's free_space_problem
        self._held: list[tuple[str, str, str | None, str, dict[str, Any] | None, str, str | None,
                               str | None, float]] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        self._error: str | None = None  # why held rows could not be written; None while all is written
        self._dropped = 0
        self._updates: list[tuple[str, str | None, str, str | None]] = []  # outcomes not yet written
        self._done_waiters: list[asyncio.Future[None]] = []  # callers of done_grouped
        self._sent_rows: list[tuple[Any, ...]] = []  # rows of sent_grouped for the next group commit
        self._sent_waiters: list[asyncio.Future[str | None]] = []
        self._tick: asyncio.Handle | None = None
        # PostgreSQL: one group commit on the worker at a time; the next one grows meanwhile (a group costs
        # its round trips whatever its size, so a slow database means bigger groups, not a longer queue)
        self._in_flight = False
        self._gate_timer: asyncio.TimerHandle | None = None  # ends the growing group's wait (GROUP_TIMEOUT_S)
        self._group_updates: list[tuple[str, str | None, str, str | None]] = []  # outcomes of unwritten `sent` rows
        self._probe_timer: asyncio.Handle | None = None
        self._probe_started: float | None = None  # monotonic start of the probe in flight
        self._probe_problem: str | None = None  # why the last probe could not write; None when it could
        self._closed = False

    def _rollback(self) -> None:
        self._engine.rollback(self._conn)

    def _offloaded_loop(self) -> asyncio.AbstractEventLoop | None:
        """The running event loop when the statements run on the worker (PostgreSQL): then a method called
        on the loop hands its work to the worker instead of waiting for it. None with SQLite or no loop."""
        if not self._engine.offload:
            return None
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return None

    async def _on_worker(self, fn: Callable[[], T]) -> T:
        """`fn` on the worker after everything handed to it before; awaited without holding the loop (with
        SQLite it runs at once)."""
        future = self._engine.submit(fn)
        if isinstance(future, Ran):
            return future.result()
        return await asyncio.wrap_future(future)

    @property
    def held(self) -> int:
        """How many audit rows (or outcomes of sent rows) wait in memory, not yet written."""
        return len(self._held) + len(self._updates)

    def _write_together(self, rows: list[tuple[Any, ...]], updates: list[tuple[str, str | None, str, str | None]]
                        ) -> None:
        """INSERT the rows, then settle the outcomes, in ONE transaction (the caller holds `_lock`; nothing is
        written when it raises). With PostgreSQL that is one round trip whatever the number of rows
        (`PostgresConnection.execute_together`): a group's cost is its round trips, not its rows. With SQLite
        it is `BEGIN` … `COMMIT` on this file (one statement alone is its own transaction)."""
        steps = [(_INSERT, [_values(row) for row in rows]),
                 # only a row still `sent` (through the index of rows in flight): an outcome is written once
                 (_SETTLE, [(status, error, rid, cid) for rid, cid, status, error in updates])]
        steps = [(sql, params) for sql, params in steps if params]
        if not steps:
            return
        if self._dialect == "postgres":
            self._conn.execute_together(steps)
            return
        if len(steps) == 1 and len(steps[0][1]) == 1:
            self._conn.execute(steps[0][0], steps[0][1][0])
            return
        self._conn.execute("BEGIN")
        try:
            for sql, params in steps:
                self._conn.executemany(sql, params)
            self._conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def _write_rows(self, rows: list[tuple[Any, ...]]) -> None:
        if rows:
            with self._lock:
                self._write_together(rows, [])

    def _write_outcomes(self, updates: list[tuple[str, str | None, str, str | None]]) -> None:
        if updates:
            with self._lock:
                self._write_together([], updates)

    def _write_sent(self, rows: list[Any]) -> None:
        with self._writing():
            self._write_rows(rows)


_INSERT = ("INSERT INTO audit (at, requested_by, device, response_id, call_id, tool_name, arguments, status, error, "
           "approved_by, approval_digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_SETTLE = "UPDATE audit SET status = ?, error = ? WHERE response_id = ? AND call_id = ? AND status = 'sent'"


def _values(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """A held row (`_full`'s ten fields, then its time) in `_INSERT`'s order."""
    who, device, call_id, tool, arguments, status, error, response_id, approved_by, digest, at = row
    return at, who, device, response_id, call_id, tool, _arguments(arguments), status, error, approved_by, digest


def _failed(exc: BaseException) -> Ran[Any]:
    """What work that could not be handed to the worker gave: `exc`."""
    def fail() -> Any:
        raise exc

    return Ran(fail)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], arg: Any) -> None:
    """`callback(arg)` on `loop`, from the worker; nothing when the loop is closed (the server has stopped)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, arg)


def _full(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An audit row with its optional trailing `approved_by` and `approval_digest` (older callers give 8 or
    9 fields): the person who approved the command and the digest of what they were shown."""
    return row if len(row) == 10 else (*row, *(None,) * (10 - len(row)))


_ARGUMENTS_JSON = json.JSONEncoder(default=str, ensure_ascii=False)  # json.dumps built one per call with these


def _arguments(arguments: dict[str, Any] | None) -> str:
    if not arguments:
        return "{}"
    text = _ARGUMENTS_JSON.encode(arguments)
    if len(text) > _MAX_ARGUMENTS_CHARS:
        text = text[:_MAX_ARGUMENTS_CHARS] + f"... [truncated, {len(text)} chars]"
    return text
