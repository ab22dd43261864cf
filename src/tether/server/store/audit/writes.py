"""`AuditWrites`: writing the `audit` table's rows and outcomes, and holding those the database refuses.

Rows are written at once (`record`, `record_many`, `sent`, `done`) or behind the caller (`record_soon`, within
`_AUDIT_FLUSH_S`). Rows that cannot be written (a full or read-only disk) are held in memory and retried, and
meanwhile `problem` says why, so that the caller refuses commands it could not audit.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from tether.server.store.audit.table import (
    UNKNOWN,
    AuditRow,
    AuditTable,
    _call_soon,
    _failed,
    _full,
    _PartsDone,
)
from tether.server.store.engine import Ran, StoreUnavailable, disk_problem, free_space_problem

logger = logging.getLogger(__package__)  # the audit log's one logger, whichever of its modules logs

_AUDIT_FLUSH_S = 0.05  # deferred audit rows are written at most this late, in one transaction
_AUDIT_FLUSH_ROWS = 64  # ... or as soon as this many are waiting
_AUDIT_HELD_MAX = 100_000  # rows kept in memory while the log cannot be written (then the oldest go, logged)
_AUDIT_RETRY_S = 1.0  # while the log cannot be written, held rows are retried this often (and before each batch)


class AuditWrites(AuditTable):
    """Writing rows and outcomes, holding and retrying those that cannot be (see the module's docstring)."""

    def close(self) -> None:
        """Write the rows held; when they cannot be, stop retrying them and log how many are lost."""
        self._closed = True
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None
        if not self.flush():
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            logger.error("closing with %d audit row(s) that could not be written: %s", len(self._held),
                         self._error)

    def record(self, requested_by: str, device: str, call_id: str | None, tool_name: str,
               arguments: dict[str, Any] | None, status: str, error: str | None,
               response_id: str | None = None, approved_by: str | None = None,
               approval_digest: str | None = None) -> None:
        """Write one audit row now (`record_many` of one row)."""
        self.record_many([(requested_by, device, call_id, tool_name, arguments, status, error, response_id,
                           approved_by, approval_digest)])

    def record_many(self, rows: Iterable[AuditRow]) -> bool:
        """Write several audit rows now, in one transaction (one per command of a batch); False when
        they could not be written, in which case they are held and retried like `record_soon`'s.

        Arguments are stored as JSON, cut at 16 KiB so a large file write cannot bloat the log.
        """
        now = time.time()
        self._held.extend((*_full(row), now) for row in rows)
        if self._offloaded_loop() is not None:  # handed to the worker in order, never waited for on the loop
            self._flush_soon()
            return self._error is None
        return self.flush()

    def sent(self, rows: Iterable[AuditRow]) -> str | None:
        """Write a batch's rows as `sent` now, before it goes to its device; None, or why they cannot be.

        The row is the command's: it exists before anything runs, so a server killed mid-command still
        has it (see `settle_sent`). Nothing is held on failure: the caller does not send the batch.
        """
        now = time.time()
        pending = [(*_full(row), now) for row in rows]
        try:
            self._engine.run_sync(lambda: self._write_sent(pending))
        except StoreUnavailable as exc:
            return f"the audit log cannot be written: {exc}"
        except sqlite3.Error as exc:
            return f"the audit log cannot be written: {exc}"
        return None

    def done(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        """Write the outcome of `sent` rows — (response_id, call_id, status, error) — before the caller
        learns it, so a delivered result is always in the log; held and retried if the disk refuses. On an
        event loop with PostgreSQL they are handed to the worker, after everything handed to it before (the
        `sent` rows they update), without waiting: the loop never waits for the database."""
        self._updates.extend(outcomes)
        if self._offloaded_loop() is not None:
            self._flush_soon()
        else:
            self.flush()

    def settle_sent(self) -> int:
        """Rows still `sent` belong to commands the previous server never heard back from: mark them
        `unknown`; how many. Only a server that holds the database alone may call this (its start-up, under
        `tether.server.store.lease`): another live server's rows in flight are still being answered."""
        # `status = 'sent'` spelled out (not bound): the planner then reads only the index of rows in flight
        def work() -> int:
            with self._writing(), self._lock:
                return int(self._conn.execute(
                    "UPDATE audit SET status = ?, error = ? WHERE status = 'sent'",
                    (UNKNOWN, "outcome unknown: the server stopped before the result came back")).rowcount)

        return self._engine.run_sync(work)

    def record_soon(self, rows: Iterable[AuditRow]) -> None:
        """Like `record_many`, but off the caller's path: on an event loop the rows are written within
        `_AUDIT_FLUSH_S` (one transaction for all rows waiting; a commit costs far more than a row),
        and every read of the log and `close()` write them first. Without a loop it writes at once.

        Rows that cannot be written (a full or read-only disk) are held in memory, at most
        `_AUDIT_HELD_MAX` of them, and retried every `_AUDIT_RETRY_S` and before each batch
        (`problem`) until they are written; meanwhile `problem` says why."""
        now = time.time()
        self._held.extend((*_full(row), now) for row in rows)
        if len(self._held) >= _AUDIT_FLUSH_ROWS and self._error is None:
            self._flush_soon()
        elif self._flush_timer is None:
            self._flush_later(_AUDIT_FLUSH_S)

    def _flush_later(self, delay: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if self._error is None:  # no loop to retry from: a failing write waits for the next call
                self.flush()
            return
        self._flush_timer = loop.call_later(delay, self._flush_soon)

    def _take(self) -> tuple[list[Any], list[Any]]:
        """The held rows and outcomes, taken out to be written (`_settle` puts back what was not)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        pending, self._held = self._held, []
        updates, self._updates = self._updates, []
        return pending, updates

    def _flush_soon(self) -> None:
        """`flush` without waiting: the held rows go to the worker, and what becomes of them is settled on
        this loop when it is done (held again and retried when they could not be written)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        pending, updates = self._take()
        if not pending and not updates:
            return

        def settle(future: Future[_PartsDone] | Ran[_PartsDone]) -> None:
            try:
                unwritten, unsettled, exc = future.result()
            except BaseException as error:
                unwritten, unsettled, exc = pending, updates, error
            self._settle(pending, unwritten, unsettled, exc)

        try:
            future = self._engine.submit(lambda: self._write_parts(pending, updates))
        except RuntimeError as exc:
            settle(_failed(exc))
            return
        if isinstance(future, Ran):
            settle(future)
        else:
            future.add_done_callback(lambda f: _call_soon(loop, settle, f))

    def flush(self) -> bool:
        """Write the rows `record_soon` is holding back (on the worker, waiting for it); False (and they stay
        held) when they cannot be."""
        pending, updates = self._take()
        if not pending and not updates:
            return True
        unwritten, unsettled, exc = self._engine.run_sync(lambda: self._write_parts(pending, updates))
        return self._settle(pending, unwritten, unsettled, exc)

    def _write_parts(self, pending: list[Any], updates: list[Any]
                     ) -> tuple[list[Any], list[Any], BaseException | None]:
        """On the worker: the held rows, then the outcomes, each in its own transaction. (rows not written,
        outcomes not written, the error that stopped them or None)."""
        try:
            self._write_rows(pending)
        except Exception as exc:
            return pending, updates, exc
        try:
            self._write_outcomes(updates)
        except Exception as exc:
            return [], updates, exc
        return [], [], None

    def _settle(self, pending: list[Any], unwritten: list[Any], unsettled: list[Any],
                exc: BaseException | None) -> bool:
        """After a write on the worker: hold again what was not written, say why, retry later; True when
        everything was written."""
        if exc is None:
            if self._error is not None:
                logger.warning("the audit log can be written again: %d held row(s) written", len(pending))
                self._error = None
            return True
        # from a timer there is no caller to tell: hold the rows, say why, retry
        problem = disk_problem(exc, self.path) or f"cannot write the audit log {self.where}: {exc}"
        self._held[:0] = unwritten
        self._updates[:0] = unsettled
        excess = len(self._held) - _AUDIT_HELD_MAX
        if excess > 0:
            del self._held[:excess]
            self._dropped += excess
            logger.error("audit log: %d held row(s) dropped, more than %d were waiting (%d dropped so far)",
                         excess, _AUDIT_HELD_MAX, self._dropped)
        if self._error is None:
            if disk_problem(exc, self.path) is None:
                logger.error("could not write %d audit row(s): %s", len(unwritten), exc)
            logger.error("the audit log cannot be written, so commands are refused until it can: %s "
                         "(%d row(s) held, retried every %gs)", problem, len(self._held), _AUDIT_RETRY_S)
        self._error = problem
        if not self._closed:
            self._flush_later(_AUDIT_RETRY_S)
        return False

    def problem(self) -> str | None:
        """None when the audit log can take a batch's rows; else one line saying why not (the disk is
        full or read-only, held rows cannot be written). The caller refuses the batch: a command that
        cannot be audited is not run. Held rows are retried here first, so a freed disk is noticed
        by the next batch."""
        if self._memory:
            return None
        full = self._free_space_this_turn()
        if full is not None:
            return f"the audit log cannot be written: {full}"
        if self._error is not None:
            if self._offloaded_loop() is not None:  # retried on the worker; refused until it is written
                self._flush_soon()
                return f"the audit log cannot be written: {self._error}"
            if not self.flush():
                return f"the audit log cannot be written: {self._error}"
        return None

    def _free_space_this_turn(self) -> str | None:
        """`free_space_problem` once per event-loop turn: every batch starting in one turn sees the same disk,
        and the REST path asks twice per batch (a statvfs each was ~3% of the server's CPU per command)."""
        if self._free_space_turn is not None:
            return self._free_space_turn[0]
        full = free_space_problem(self._directory)  # a str: `Path.parent` per call cost more than the statvfs
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return full
        self._free_space_turn = (full,)
        loop.call_soon(self._forget_free_space)
        return full

    def _forget_free_space(self) -> None:
        self._free_space_turn = None
