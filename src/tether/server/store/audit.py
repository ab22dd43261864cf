"""`AuditLog`: the `audit` table, the record of every command — who asked, which device, what, and how it ended.

A command's row is written as `sent` before it goes to its device (`sent_grouped`, `sent`) and settled with
its outcome (`done_grouped`, `done`, `done_queued`; `late` for an outcome that came after its caller's wait
ended); rows that are not a command's path are written behind it (`record_soon`) or at once
(`record`, `record_many`). Rows that cannot be written (a full or read-only disk) are held in memory and
retried, and meanwhile `problem` says why, so that the caller refuses commands it could not audit. Reads
(`rows`, `batch`) write what is held first.

With PostgreSQL every statement on the `audit` table runs on the engine's worker thread, on the audit
connection (`Engine.worker`, `Engine.audit_conn`), in the order it was given (with SQLite `Engine.offload` is
off and they run at once, on the caller's thread). The group commits (`sent_grouped`,
`done_grouped`) and the deferred rows (`record_soon`) are handed to it without waiting: the event loop goes
on while the database is slow, locked or gone, and only the callers awaiting those futures wait (at most
`GROUP_TIMEOUT_S`). The other methods wait for the worker. `health` says from state, without a statement,
whether the log can be written; a probe on the worker keeps that state current.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from tether.server.store.engine import Engine, Ran, StoreUnavailable, T, disk_problem, free_space_problem

logger = logging.getLogger(__name__)

_MAX_ARGUMENTS_CHARS = 16_384
_AUDIT_FLUSH_S = 0.05  # deferred audit rows are written at most this late, in one transaction
_AUDIT_FLUSH_ROWS = 64  # ... or as soon as this many are waiting
_AUDIT_HELD_MAX = 100_000  # rows kept in memory while the log cannot be written (then the oldest go, logged)
_AUDIT_RETRY_S = 1.0  # while the log cannot be written, held rows are retried this often (and before each batch)
GROUP_TIMEOUT_S = 35.0  # a group commit's callers are told "cannot be written" after this long (statements: 30 s)
PROBE_INTERVAL_S = 1.0  # the health probe runs this often while the server answers /health or commands
PROBE_TIMEOUT_S = 2.0  # a probe (or the work queued before it) not done after this long: the database is stalled
PROBE_LOCK_TIMEOUT_MS = 1000  # PostgreSQL: the probe waits this long for the audit table's write lock

# requested_by, device, call_id, tool_name, arguments, status, error, response_id[, approved_by[, approval_digest]]
AuditRow = tuple[Any, ...]
# what a write on the worker gave: (rows not written, outcomes not written, the error that stopped them)
_PartsDone = tuple[list[Any], list[Any], BaseException | None]
_GroupDone = tuple[str | None, list[Any], list[Any], BaseException | None]  # (why `sent` failed, *_PartsDone)

SENT, UNKNOWN, PENDING = "sent", "unknown", "pending"
LATE_NOTE = "late: this outcome came back after the caller's wait had ended"
_BATCH_WINDOW = 200_000  # GET /batches/{id} looks for a batch's rows among the newest this many audit rows


class AuditLog:
    """The `audit` table of a `Store` (`store.audit`); see the module's docstring."""

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

    def sent_grouped(self, rows: Iterable[AuditRow]) -> asyncio.Future[str | None]:
        """`sent` by group commit: the `sent` rows of every batch starting in this turn of the event
        loop are inserted in one transaction; the future gives None once they are written, or why they
        could not be (then the caller does not send its batch, and nothing is held). The row still
        exists before the command goes. One INSERT commit per command was the largest single cost on
        the command path (11% of the server's CPU, bench/fleet_hotpath.py)."""
        loop = asyncio.get_running_loop()
        now = time.time()
        self._sent_rows.extend((*_full(row), now) for row in rows)
        waiter: asyncio.Future[str | None] = loop.create_future()
        self._sent_waiters.append(waiter)
        self._schedule_group(loop)
        return waiter

    def done_grouped(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]
                     ) -> asyncio.Future[None]:
        """`done` by group commit: the outcomes of every batch that ends in the same turn of the
        event loop are written in one transaction, and each caller goes on once it is written (or held,
        as `done`'s are), so the caller still learns a result only after the log has it — also
        for a reader in another process. One UPDATE commit per command cost ~5% of the server's CPU
        on the command path (bench/fleet_hotpath.py). The caller awaits the future it returns (a plain
        function: no coroutine per command)."""
        loop = asyncio.get_running_loop()
        self._updates.extend(outcomes)
        waiter: asyncio.Future[None] = loop.create_future()
        self._done_waiters.append(waiter)
        self._schedule_group(loop)
        return waiter

    def done_queued(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        """`done` for a caller that cannot wait (it is being cancelled): written with the next group
        commit when one is due — after the `sent` rows it updates — else now."""
        if self._tick is None and not self._sent_rows:  # its `sent` rows are written or handed to the worker
            self.done(outcomes)
            return
        self._group_updates.extend(outcomes)  # with the group of its `sent` rows, after them

    def _schedule_group(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._tick is None:
            self._tick = loop.call_soon(self._group_commit)

    def _group_commit(self) -> None:
        """Hand this turn's group to the worker; its callers' futures are set when it is done there (or
        after `GROUP_TIMEOUT_S`, with the problem, when it is not)."""
        self._tick = None
        loop = asyncio.get_running_loop()
        if self._in_flight:  # the group grows until the one on the worker is back (`settle` hands it over)
            if self._gate_timer is None and self._sent_waiters:
                self._gate_timer = loop.call_later(GROUP_TIMEOUT_S, self._gate_expired)
            return
        sent, self._sent_rows = self._sent_rows, []
        sent_waiters, self._sent_waiters = self._sent_waiters, []
        waiters, self._done_waiters = self._done_waiters, []
        pending, updates = self._take()
        updates += self._group_updates
        self._group_updates = []
        one_transaction = self._error is None
        if self._probe_timer is None:
            self._ensure_probe(loop)
        if not self._engine.offload:  # SQLite: at once, on this thread (see `Engine`)
            self._group_now(sent, pending, updates, sent_waiters, waiters, one_transaction=one_transaction)
            return

        def work() -> tuple[str | None, list[Any], list[Any], BaseException | None]:
            return self._group_work(sent, pending, updates, one_transaction=one_transaction)

        def answer(problem: str | None) -> None:
            for sent_waiter in sent_waiters:
                if not sent_waiter.done():
                    sent_waiter.set_result(problem)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

        late = _late_group()
        abandoned: list[bool] = []  # set when the callers were answered before the worker was done

        def timed_out() -> None:
            abandoned.append(True)
            answer(late)

        timers: list[asyncio.TimerHandle] = []

        def settle(future: Future[_GroupDone] | Ran[_GroupDone]) -> None:
            for timer in timers:
                timer.cancel()
            try:
                sent_problem, unwritten, unsettled, exc = future.result()
            except BaseException as error:
                sent_problem, unwritten, unsettled, exc = f"the audit log cannot be written: {error}", pending, \
                    updates, error
            if abandoned and sent and sent_problem is None:  # written after its callers were told it was not:
                # those commands were never sent, and their rows say so (an outcome is written once)
                self._updates.extend((r[7], r[2], "failure", f"not sent: {late}") for r in sent)
                self._flush_later(0)
            try:
                self._settle(pending, unwritten, unsettled, exc)
            finally:
                answer(sent_problem)
                self._in_flight = False
                if self._gate_timer is not None:
                    self._gate_timer.cancel()
                    self._gate_timer = None
                if self._sent_rows or self._sent_waiters or self._done_waiters or self._group_updates:
                    self._schedule_group(loop)

        self._in_flight = True
        try:
            future = self._engine.submit(work)
        except RuntimeError as exc:  # the store is closed
            settle(_failed(exc))
            return
        if isinstance(future, Ran):  # run at once (`Engine.offload` is off: SQLite)
            settle(future)
            return
        timers.append(loop.call_later(GROUP_TIMEOUT_S, timed_out))
        future.add_done_callback(lambda f: _call_soon(loop, settle, f))

    def _gate_expired(self) -> None:
        """The group waiting for the one on the worker has waited `GROUP_TIMEOUT_S`: its callers are told the
        log cannot be written (their commands are not sent, and their rows are never handed over)."""
        self._gate_timer = None
        self._sent_rows = []
        sent_waiters, self._sent_waiters = self._sent_waiters, []
        waiters, self._done_waiters = self._done_waiters, []
        for sent_waiter in sent_waiters:
            if not sent_waiter.done():
                sent_waiter.set_result(_late_group())
        for waiter in waiters:  # their outcomes stay queued and are written with a later group
            if not waiter.done():
                waiter.set_result(None)

    def _group_now(self, sent: list[Any], pending: list[Any], updates: list[Any],
                   sent_waiters: list[asyncio.Future[str | None]], waiters: list[asyncio.Future[None]], *,
                   one_transaction: bool) -> None:
        """`_group_commit` without a worker: the group written now, its callers answered now."""
        sent_problem: str | None = None
        try:
            sent_problem, unwritten, unsettled, exc = self._group_work(sent, pending, updates,
                                                                       one_transaction=one_transaction)
            self._settle(pending, unwritten, unsettled, exc)
        finally:
            for sent_waiter in sent_waiters:
                if not sent_waiter.done():
                    sent_waiter.set_result(sent_problem)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _group_work(self, sent: list[Any], pending: list[Any], updates: list[Any], *, one_transaction: bool
                    ) -> tuple[str | None, list[Any], list[Any], BaseException | None]:
        """On the worker: the group's rows and outcomes in one transaction, or part by part when that fails
        (each part with its own error rules). (why the `sent` rows could not be written or None, the held
        rows and outcomes not written, the error that stopped them or None)."""
        if one_transaction and self._commit_group(sent, pending, updates):  # the common case
            return None, [], [], None
        problem: str | None = None
        if sent:
            try:
                self._write_sent(sent)
            except (StoreUnavailable, sqlite3.Error) as exc:
                problem = f"the audit log cannot be written: {exc}"
        return (problem, *self._write_parts(pending, updates))

    def _write_sent(self, rows: list[Any]) -> None:
        with self._writing():
            self._write_rows(rows)

    def _commit_group(self, sent: list[tuple[Any, ...]], pending: list[Any], updates: list[Any]) -> bool:
        """The group's `sent` rows, the rows `record_soon` holds and the outcomes waiting, in ONE transaction:
        a commit (its WAL pages and locks) costs more than its rows, and the insert and the outcome
        updates touch the same pages. False, with nothing written, when it fails: `_group_work` then
        writes each part on its own, with each part's own error rules."""
        if not sent and not pending and not updates:
            return True
        with self._lock:
            try:
                self._conn.execute("BEGIN")
                self._insert_rows([*sent, *pending])
                self._update_outcomes(updates)
                self._conn.execute("COMMIT")
            except Exception:  # retried part by part, where each failure is reported
                self._rollback()
                return False
        return True

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
        the table's write lock (PostgreSQL, waiting at most `PROBE_LOCK_TIMEOUT_MS`; SQLite: the database's
        write lock, `BEGIN IMMEDIATE`) and rolls back."""
        if self._memory and self._dialect == "sqlite":
            return None
        try:
            with self._writing(), self._lock:
                try:
                    if self._dialect == "postgres":
                        self._conn.execute("BEGIN")
                        self._conn.execute(f"SET LOCAL lock_timeout = {PROBE_LOCK_TIMEOUT_MS}")
                        self._conn.execute("LOCK TABLE audit IN ROW EXCLUSIVE MODE")
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

    @property
    def held(self) -> int:
        """How many audit rows (or outcomes of sent rows) wait in memory, not yet written."""
        return len(self._held) + len(self._updates)

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> None:
        """INSERT the rows, inside the caller's transaction (or as one autocommit statement for one row)."""
        if not rows:
            return
        values = [(at, who, device, response_id, call_id, tool, _arguments(arguments), status, error, approved_by,
                   digest)
                  for who, device, call_id, tool, arguments, status, error, response_id, approved_by, digest, at
                  in rows]
        insert = ("INSERT INTO audit (at, requested_by, device, response_id, call_id, tool_name, arguments, "
                  "status, error, approved_by, approval_digest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
        if len(values) == 1:
            self._conn.execute(insert, values[0])
        else:
            self._conn.executemany(insert, values)

    def _update_outcomes(self, updates: list[tuple[str, str | None, str, str | None]]) -> None:
        if updates:
            # only a row still `sent` (through the index of rows in flight): an outcome is written once
            self._conn.executemany("UPDATE audit SET status = ?, error = ? "
                                   "WHERE response_id = ? AND call_id = ? AND status = 'sent'",
                                   [(status, error, rid, cid) for rid, cid, status, error in updates])

    def _write_rows(self, rows: list[tuple[Any, ...]]) -> None:
        if not rows:
            return
        with self._lock:
            if len(rows) == 1:  # one statement is its own transaction (the common one-command batch)
                self._insert_rows(rows)
                return
            self._conn.execute("BEGIN")
            try:
                self._insert_rows(rows)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def _write_outcomes(self, updates: list[tuple[str, str | None, str, str | None]]) -> None:
        if not updates:
            return
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                self._update_outcomes(updates)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def late(self, device: str, outcomes: list[tuple[str, str, str, str | None]]) -> int:
        """Settle rows with an outcome that came back after the caller's wait ended: (response_id, call_id,
        status, error) from `device`. Only a row of that device, that batch and that call whose outcome is
        not known yet (`sent`, `pending`, `unknown`) changes — an outcome is written once, and a device
        cannot settle another's rows; its error gets `LATE_NOTE`. Written now (a late result is rare and
        must not wait for a caller that is gone); returns how many rows changed."""
        self.flush()  # the `sent` rows and outcomes held back go first
        return self._engine.run_sync(lambda: self._late(device, outcomes))

    def _late(self, device: str, outcomes: list[tuple[str, str, str, str | None]]) -> int:
        changed = 0
        with self._writing(), self._lock:
            self._conn.execute("BEGIN")
            try:
                for rid, cid, status, error in outcomes:
                    note = f"{LATE_NOTE}{': ' + error if error else ''}"
                    for unsettled in ("status = 'sent'", "status IN ('pending', 'unknown')"):  # one index each
                        cur = self._conn.execute(
                            "UPDATE audit SET status = ?, error = ? WHERE response_id = ? AND call_id = ? "  # noqa: S608
                            f"AND device = ? AND {unsettled}", (status, note, rid, cid, device))
                        changed += max(cur.rowcount, 0)
                self._conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return changed

    def response_of(self, device: str, call_id: str) -> str | None:
        """The `response_id` of the newest batch that carried `call_id` to `device`, among the rows whose
        outcome is still open (whatever their age) and else the newest `_BATCH_WINDOW` rows; None when no
        row has it. What a node taking over a task needs to ask the device about the step in flight."""
        self.flush()

        def work() -> Any:
            with self._lock:
                row = self._conn.execute(
                    "SELECT response_id FROM audit WHERE status IN ('sent', 'pending', 'unknown') AND call_id = ? "
                    "AND device = ? ORDER BY id DESC LIMIT 1", (call_id, device)).fetchone()
                if row is None:
                    top = self._conn.execute("SELECT max(id) FROM audit").fetchone()[0] or 0
                    row = self._conn.execute(
                        "SELECT response_id FROM audit WHERE id > ? AND call_id = ? AND device = ? ORDER BY id DESC "
                        "LIMIT 1", (top - _BATCH_WINDOW, call_id, device)).fetchone()
                return row

        row = self._engine.run_sync(work)
        return str(row[0]) if row is not None and row[0] else None

    def restarted(self, device: str) -> int | None:
        """`device` came back as a new process: its `pending` rows will get no answer (the old process and
        its commands are gone), so they become `unknown`, saying so; a late answer may still settle them.
        How many rows changed; None when, on an event loop with PostgreSQL, the update was handed to the
        worker instead of waited for (it logs the count once done)."""
        loop = self._offloaded_loop()
        if loop is not None:
            self._flush_soon()
        else:
            self.flush()

        def work() -> int:
            with self._writing(), self._lock:
                cur = self._conn.execute(
                    "UPDATE audit SET status = 'unknown', error = ? || coalesce(error, '') "
                    "WHERE status IN ('pending', 'unknown') AND status = 'pending' AND device = ?",
                    (f"outcome unknown: device {device} restarted (a new process) before the result came back; "
                     "the command was stopped with the old process, if it had started. Before: ", device))
            return max(cur.rowcount, 0)

        if loop is None:
            return self._engine.run_sync(work)

        def settled(future: Future[int]) -> None:
            try:
                count = future.result()
            except Exception as exc:
                logger.error("could not settle the pending outcomes of restarted device %s: %s", device, exc)
                return
            if count:
                logger.warning("device %s restarted: %d pending outcome(s) of its old process settled as unknown",
                               device, count)

        try:
            self._engine.worker.submit(work).add_done_callback(settled)
        except RuntimeError as exc:  # the store is closed
            logger.error("could not settle the pending outcomes of restarted device %s: %s", device, exc)
        return None

    def batch(self, response_id: str) -> list[dict[str, Any]]:
        """The audit rows of the batch `response_id`, oldest first: its record (what was asked, of which
        device, by whom, and each command's outcome so far). Looked for among the newest `_BATCH_WINDOW`
        rows (the log has no index of every row by batch: it cost each insert dearly), and among the
        rows whose outcome is still open whatever their age. Waits for the database: on an event loop
        use `read_batch`."""
        self.flush()
        return [dict(r) for r in self._engine.run_sync(self._batch_work(response_id))]

    async def read_batch(self, response_id: str) -> list[dict[str, Any]]:
        """`batch` for the event loop: the statement runs on the worker (PostgreSQL) and only this caller
        waits for it — a locked or stopped database delays this request, not the server."""
        self._write_before_read()
        return [dict(r) for r in await self._on_worker(self._batch_work(response_id))]

    def _write_before_read(self) -> None:
        """What is held goes first: at once (SQLite), or handed to the worker ahead of the read."""
        if self._offloaded_loop() is not None:
            self._flush_soon()
        else:
            self.flush()

    def _batch_work(self, response_id: str) -> Callable[[], list[Any]]:
        def work() -> list[Any]:
            with self._lock:
                top = self._conn.execute("SELECT max(id) FROM audit").fetchone()[0] or 0
                rows = self._conn.execute("SELECT * FROM audit WHERE id > ? AND response_id = ? ORDER BY id",
                                          (top - _BATCH_WINDOW, response_id)).fetchall()
                if not rows:
                    rows = self._conn.execute(
                        "SELECT * FROM audit WHERE response_id = ? AND status IN ('pending', 'unknown') ORDER BY id",
                        (response_id,)).fetchall()
                return rows

        return work

    def rows(self, limit: int = 100, device: str | None = None, *, task: str | None = None,
             token: str | None = None, since: float | None = None, until: float | None = None,
             before: int | None = None, devices: list[str] | None = None) -> list[dict[str, Any]]:
        """The newest `limit` audit rows matching every filter given, newest first, as plain dicts.

        `token` is an API token's name: its own commands and those of the tasks and undos it started
        (`requested_by` records them as `api:NAME`, `task:ID for api:NAME`, `undo:ID by api:NAME`).
        `task` is a task id or a prefix of it; `before` is a row id, the cursor of the next page.
        `devices` (a scoped token's devices) keeps only their rows; an empty list keeps none. Waits for the
        database: on an event loop use `read_rows`."""
        self.flush()
        return [dict(r) for r in self._engine.run_sync(self._rows_work(limit, device, task=task, token=token,
                                                                       since=since, until=until, before=before,
                                                                       devices=devices))]

    async def read_rows(self, limit: int = 100, device: str | None = None, *, task: str | None = None,
                        token: str | None = None, since: float | None = None, until: float | None = None,
                        before: int | None = None, devices: list[str] | None = None) -> list[dict[str, Any]]:
        """`rows` for the event loop: the statement runs on the worker (PostgreSQL) and only this caller
        waits for it."""
        self._write_before_read()
        return [dict(r) for r in await self._on_worker(self._rows_work(limit, device, task=task, token=token,
                                                                       since=since, until=until, before=before,
                                                                       devices=devices))]

    def _rows_work(self, limit: int, device: str | None, *, task: str | None, token: str | None,
                   since: float | None, until: float | None, before: int | None, devices: list[str] | None
                   ) -> Callable[[], list[Any]]:
        where: list[str] = []
        params: list[Any] = []
        if devices is not None:
            where.append(f"device IN ({', '.join('?' * len(devices))})" if devices else "1 = 0")
            params += devices
        if device is not None:
            where.append("device = ?")
            params.append(device)
        if token is not None:
            where.append("(requested_by = ? OR requested_by LIKE ? ESCAPE '\\' OR requested_by LIKE ? ESCAPE '\\')")
            name = _like(f"api:{token}")
            params += [f"api:{token}", f"% for {name}", f"% by {name}"]
        if task is not None:
            where.append("(requested_by LIKE ? ESCAPE '\\' OR requested_by LIKE ? ESCAPE '\\')")
            prefix = _like(task[:12])
            params += [f"task:{prefix}%", f"undo:{prefix}%"]
        for column, op, value in (("at", ">=", since), ("at", "<", until), ("id", "<", before)):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        # only constant fragments are joined; every value is a bound parameter
        query = "SELECT * FROM audit" + (" WHERE " + " AND ".join(where) if where else "")  # noqa: S608

        def work() -> list[Any]:
            with self._lock:
                return self._conn.execute(query + " ORDER BY id DESC LIMIT ?", (*params, int(limit))).fetchall()

        return work


def _late_group() -> str:
    return f"the audit log cannot be written: the database did not answer within {GROUP_TIMEOUT_S:g}s"


def _failed(exc: BaseException) -> Ran[Any]:
    """What work that could not be handed to the worker gave: `exc`."""
    def fail() -> Any:
        raise exc

    return Ran(fail)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], arg: Any) -> None:
    """`callback(arg)` on `loop`, from the worker; nothing when the loop is closed (the server has stopped)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, arg)


def _like(text: str) -> str:
    """`text` with LIKE's wildcards escaped, so a name is matched as written."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


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
