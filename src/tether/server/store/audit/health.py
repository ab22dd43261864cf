"""`AuditHealth`: whether the audit log can be written, answered from state; a probe on the worker keeps it current."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from concurrent.futures import Future

from tether.server.store.audit.table import _call_soon, _failed
from tether.server.store.audit.writes import AuditWrites
from tether.server.store.engine import Ran, StoreUnavailable

PROBE_INTERVAL_S = 1.0  # the health probe runs this often while the server answers /health or commands
PROBE_TIMEOUT_S = 2.0  # a probe (or the work queued before it) not done after this long: the database is stalled
PROBE_LOCK_TIMEOUT_MS = 1000  # PostgreSQL: the probe waits this long for the audit table's write lock


class AuditHealth(AuditWrites):
    """`health` and the probe behind it (see the module's docstring)."""

    def health(self) -> str | None:
        """None when the audit log can be written, as far as is known now; else one line saying why not (a
        full or read-only disk, held rows that cannot be written, the database stopped, locked or not
        answering). Answered from state, without a statement: what the last probe on the worker found, a
        probe (or the work queued before it) taking longer than `PROBE_TIMEOUT_S`, the held rows' error.
        Starts the probe, every `PROBE_INTERVAL_S` from then on, when called on an event loop."""
        with contextlib.suppress(RuntimeError):
            self._ensure_probe(asyncio.get_running_loop())
        if not self._memory:
            full = self._free_space_this_turn()
            if full is not None:
                return full
        if self._probe_started is not None and time.monotonic() - self._probe_started > PROBE_TIMEOUT_S:
            return (f"the database did not answer within {PROBE_TIMEOUT_S:g}s (a lock, a stalled or lost "
                    f"connection): {self.where}")
        return self._error or self._probe_problem

    def _ensure_probe(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._probe_timer is None and not self._closed:
            self._probe_timer = loop.call_soon(self._probe_tick)

    def _probe_tick(self) -> None:
        """Hand the worker a probe unless one is still there; again in `PROBE_INTERVAL_S`."""
        loop = asyncio.get_running_loop()
        if self._closed:
            self._probe_timer = None
            return
        self._probe_timer = loop.call_later(PROBE_INTERVAL_S, self._probe_tick)
        if self._probe_started is not None:
            return  # still queued or running: `health` reports it once it is late
        self._probe_started = time.monotonic()

        def settle(future: Future[str | None] | Ran[str | None]) -> None:
            self._probe_started = None
            try:
                self._probe_problem = future.result()
            except BaseException as exc:
                self._probe_problem = f"the audit log cannot be written: {exc}"

        try:
            future = self._engine.submit(self._probe)
        except RuntimeError as exc:
            settle(_failed(exc))
            return
        if isinstance(future, Ran):
            settle(future)
        else:
            future.add_done_callback(lambda f: _call_soon(loop, settle, f))

    def _probe(self) -> str | None:
        """On the worker: can the audit table be written now? None, or why not. It writes nothing: it takes
        the table's write lock (PostgreSQL, waiting at most `PROBE_LOCK_TIMEOUT_MS`: `BEGIN` … `ROLLBACK` in one
        round trip; SQLite: the database's write lock, `BEGIN IMMEDIATE`, rolled back)."""
        if self._memory and self._dialect == "sqlite":
            return None
        try:
            with self._writing(), self._lock:
                try:
                    if self._dialect == "postgres":  # a failed step leaves the transaction to `_rollback`
                        self._conn.execute_together([(sql, [()]) for sql in (
                            "BEGIN", f"SET LOCAL lock_timeout = {PROBE_LOCK_TIMEOUT_MS}",
                            "LOCK TABLE audit IN ROW EXCLUSIVE MODE", "ROLLBACK")])
                    else:
                        self._conn.execute("BEGIN IMMEDIATE")
                finally:
                    self._rollback()
        except (StoreUnavailable, sqlite3.Error) as exc:
            text = str(exc)
            if "lock timeout" in text or "timed out" in text or "locked" in text:
                return f"the audit table is locked (waited {PROBE_LOCK_TIMEOUT_MS} ms): {text}"
            return f"the audit log cannot be written: {text}"
        return None
