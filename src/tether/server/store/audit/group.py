"""`GroupCommit`: the `sent` rows and outcomes of every batch in one event-loop turn, written in one transaction.

With PostgreSQL the group is handed to the engine's worker without waiting: the event loop goes on while the
database is slow, locked or gone, and only the callers awaiting the futures wait (at most `GROUP_TIMEOUT_S`).
One group is on the worker at a time; the next one grows meanwhile. With SQLite the group is written at once.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from tether.server.store.audit.health import AuditHealth
from tether.server.store.audit.table import AuditRow, _call_soon, _failed, _full, _GroupDone
from tether.server.store.engine import Ran, StoreUnavailable

GROUP_TIMEOUT_S = 35.0  # a group commit's callers are told "cannot be written" after this long (statements: 30 s)


class GroupCommit(AuditHealth):
    """`sent_grouped`, `done_grouped` and `done_queued` (see the module's docstring)."""

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

    def _commit_group(self, sent: list[tuple[Any, ...]], pending: list[Any], updates: list[Any]) -> bool:
        """The group's `sent` rows, the rows `record_soon` holds and the outcomes waiting, in ONE transaction
        (`_write_together`: with PostgreSQL one round trip): a commit (its WAL pages and locks, or its trip to
        the database) costs more than its rows, and the insert and the outcome updates touch the same pages.
        False, with nothing written, when it fails: `_group_work` then writes each part on its own, with each
        part's own error rules."""
        if not sent and not pending and not updates:
            return True
        with self._lock:
            try:
                self._write_together([*sent, *pending], updates)
            except Exception:  # retried part by part, where each failure is reported
                return False
        return True


def _late_group() -> str:
    return f"the audit log cannot be written: the database did not answer within {GROUP_TIMEOUT_S:g}s"
