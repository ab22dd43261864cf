"""`AuditLog`: the `audit` table, the record of every command — who asked, which device, what, and how it ended.

A command's row is written as `sent` before it goes to its device (`sent_grouped`, `sent`) and settled with
its outcome (`done_grouped`, `done`, `done_queued`; `late` for an outcome that came after its caller's wait
ended); rows that are not a command's path are written behind it (`record_soon`) or at once
(`record`, `record_many`). Rows that cannot be written (a full or read-only disk) are held in memory and
retried, and meanwhile `problem` says why, so that the caller refuses commands it could not audit. Reads
(`rows`, `batch`) write what is held first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from tether.server.store.engine import Engine, StoreUnavailable, disk_problem, free_space_problem

logger = logging.getLogger(__name__)

_MAX_ARGUMENTS_CHARS = 16_384
_AUDIT_FLUSH_S = 0.05  # deferred audit rows are written at most this late, in one transaction
_AUDIT_FLUSH_ROWS = 64  # ... or as soon as this many are waiting
_AUDIT_HELD_MAX = 100_000  # rows kept in memory while the log cannot be written (then the oldest go, logged)
_AUDIT_RETRY_S = 1.0  # while the log cannot be written, held rows are retried this often (and before each batch)

# requested_by, device, call_id, tool_name, arguments, status, error, response_id[, approved_by[, approval_digest]]
AuditRow = tuple[Any, ...]

SENT, UNKNOWN, PENDING = "sent", "unknown", "pending"
LATE_NOTE = "late: this outcome came back after the caller's wait had ended"
_BATCH_WINDOW = 200_000  # GET /batches/{id} looks for a batch's rows among the newest this many audit rows


class AuditLog:
    """The `audit` table of a `Store` (`store.audit`); see the module's docstring."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn, self._lock, self._writing = engine.conn, engine.lock, engine.writing
        self._rollback = engine.rollback
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

    def close(self) -> None:
        """Write the rows held; when they cannot be, stop retrying them and log how many are lost."""
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
        return self.flush()

    def sent(self, rows: Iterable[AuditRow]) -> str | None:
        """Write a batch's rows as `sent` now, before it goes to its device; None, or why they cannot be.

        The row is the command's: it exists before anything runs, so a server killed mid-command still
        has it (see `settle_sent`). Nothing is held on failure: the caller does not send the batch.
        """
        now = time.time()
        pending = [(*_full(row), now) for row in rows]
        try:
            with self._writing():
                self._write_rows(pending)
        except StoreUnavailable as exc:
            return f"the audit log cannot be written: {exc}"
        except sqlite3.Error as exc:
            return f"the audit log cannot be written: {exc}"
        return None

    def done(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        """Write the outcome of `sent` rows — (response_id, call_id, status, error) — before the caller
        learns it, so a delivered result is always in the log; held and retried if the disk refuses."""
        with self._lock:
            self._updates.extend(outcomes)
        self.flush()

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
        with self._lock:
            self._updates.extend(outcomes)
        waiter: asyncio.Future[None] = loop.create_future()
        self._done_waiters.append(waiter)
        self._schedule_group(loop)
        return waiter

    def done_queued(self, outcomes: Iterable[tuple[str, str | None, str, str | None]]) -> None:
        """`done` for a caller that cannot wait (it is being cancelled): written with the next group
        commit when one is due — after the `sent` rows it updates — else now."""
        if self._tick is None:
            self.done(outcomes)
            return
        with self._lock:
            self._updates.extend(outcomes)

    def _schedule_group(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._tick is None:
            self._tick = loop.call_soon(self._group_commit)

    def _group_commit(self) -> None:
        self._tick = None
        sent, self._sent_rows = self._sent_rows, []
        sent_waiters, self._sent_waiters = self._sent_waiters, []
        waiters, self._done_waiters = self._done_waiters, []
        problem: str | None = None
        if self._error is None and self._commit_group(sent):  # the common case: one transaction
            for sent_waiter in sent_waiters:
                if not sent_waiter.done():
                    sent_waiter.set_result(None)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            return
        try:
            if sent:
                try:
                    with self._writing():
                        self._write_rows(sent)
                except (StoreUnavailable, sqlite3.Error) as exc:
                    problem = f"the audit log cannot be written: {exc}"
        finally:
            for sent_waiter in sent_waiters:
                if not sent_waiter.done():
                    sent_waiter.set_result(problem)
        try:
            self.flush()  # a failure holds the rows and retries them (`problem` says why)
        finally:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def _commit_group(self, sent: list[tuple[Any, ...]]) -> bool:
        """The group's `sent` rows, the rows `record_soon` holds and the outcomes waiting, in ONE transaction:
        a commit (its WAL pages and locks) costs more than its rows, and the insert and the outcome
        updates touch the same pages. False, with nothing written and everything where it was, when
        it fails: `_group_commit` then writes each part on its own, with each part's own error rules."""
        with self._lock:
            pending, updates = self._held, self._updates
            if not sent and not pending and not updates:
                return True
            try:
                self._conn.execute("BEGIN")
                self._insert_rows([*sent, *pending])
                self._update_outcomes(updates)
                self._conn.execute("COMMIT")
            except Exception:  # retried part by part, where each failure is reported
                self._rollback()
                return False
            self._held, self._updates = [], []
        if pending and self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        return True

    def settle_sent(self) -> int:
        """Rows still `sent` belong to commands the previous server never heard back from: mark them
        `unknown`; how many. Only a server that holds the database alone may call this (its start-up, under
        `tether.server.store.lease`): another live server's rows in flight are still being answered."""
        # `status = 'sent'` spelled out (not bound): the planner then reads only the index of rows in flight
        with self._writing(), self._lock:
            return self._conn.execute("UPDATE audit SET status = ?, error = ? WHERE status = 'sent'",
                                      (UNKNOWN, "outcome unknown: the server stopped before the result came back")
                                      ).rowcount

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
            self.flush()
        elif self._flush_timer is None:
            self._flush_later(_AUDIT_FLUSH_S)

    def _flush_later(self, delay: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if self._error is None:  # no loop to retry from: a failing write waits for the next call
                self.flush()
            return
        self._flush_timer = loop.call_later(delay, self.flush)

    def flush(self) -> bool:
        """Write the rows `record_soon` is holding back; False (and they stay held) when they cannot be."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        with self._lock:
            pending, self._held = self._held, []
            updates, self._updates = self._updates, []
        if not pending and not updates:
            return True
        try:
            self._write_rows(pending)
            pending = []
            self._write_outcomes(updates)
        except Exception as exc:  # from a timer there is no caller to tell: hold the rows, say why, retry
            problem = disk_problem(exc, self.path) or f"cannot write the audit log {self.where}: {exc}"
            with self._lock:
                self._held[:0] = pending
                self._updates[:0] = updates
                excess = len(self._held) - _AUDIT_HELD_MAX
                if excess > 0:
                    del self._held[:excess]
                    self._dropped += excess
            if excess > 0:
                logger.error("audit log: %d held row(s) dropped, more than %d were waiting (%d dropped so far)",
                             excess, _AUDIT_HELD_MAX, self._dropped)
            if self._error is None:
                if disk_problem(exc, self.path) is None:
                    logger.exception("could not write %d audit row(s)", len(pending))
                logger.error("the audit log cannot be written, so commands are refused until it can: %s "
                             "(%d row(s) held, retried every %gs)", problem, len(self._held),
                             _AUDIT_RETRY_S)
            self._error = problem
            self._flush_later(_AUDIT_RETRY_S)
            return False
        if self._error is not None:
            logger.warning("the audit log can be written again: %d held row(s) written", len(pending))
            self._error = None
        return True

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
        if self._error is not None and not self.flush():
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
        with self._lock:
            row = self._conn.execute(
                "SELECT response_id FROM audit WHERE status IN ('sent', 'pending', 'unknown') AND call_id = ? "
                "AND device = ? ORDER BY id DESC LIMIT 1", (call_id, device)).fetchone()
            if row is None:
                top = self._conn.execute("SELECT max(id) FROM audit").fetchone()[0] or 0
                row = self._conn.execute(
                    "SELECT response_id FROM audit WHERE id > ? AND call_id = ? AND device = ? ORDER BY id DESC "
                    "LIMIT 1", (top - _BATCH_WINDOW, call_id, device)).fetchone()
        return str(row[0]) if row is not None and row[0] else None

    def restarted(self, device: str) -> int:
        """`device` came back as a new process: its `pending` rows will get no answer (the old process and
        its commands are gone), so they become `unknown`, saying so; a late answer may still settle them."""
        self.flush()
        with self._writing(), self._lock:
            cur = self._conn.execute(
                "UPDATE audit SET status = 'unknown', error = ? || coalesce(error, '') "
                "WHERE status IN ('pending', 'unknown') AND status = 'pending' AND device = ?",
                (f"outcome unknown: device {device} restarted (a new process) before the result came back; the "
                 "command was stopped with the old process, if it had started. Before: ", device))
        return max(cur.rowcount, 0)

    def batch(self, response_id: str) -> list[dict[str, Any]]:
        """The audit rows of the batch `response_id`, oldest first: its record (what was asked, of which
        device, by whom, and each command's outcome so far). Looked for among the newest `_BATCH_WINDOW`
        rows (the log has no index of every row by batch: it cost each insert dearly), and among the
        rows whose outcome is still open whatever their age."""
        self.flush()
        with self._lock:
            top = self._conn.execute("SELECT max(id) FROM audit").fetchone()[0] or 0
            rows = self._conn.execute(
                "SELECT * FROM audit WHERE id > ? AND response_id = ? ORDER BY id", (top - _BATCH_WINDOW, response_id)
            ).fetchall()
            if not rows:
                rows = self._conn.execute(
                    "SELECT * FROM audit WHERE response_id = ? AND status IN ('pending', 'unknown') ORDER BY id",
                    (response_id,)).fetchall()
        return [dict(r) for r in rows]

    def rows(self, limit: int = 100, device: str | None = None, *, task: str | None = None,
             token: str | None = None, since: float | None = None, until: float | None = None,
             before: int | None = None, devices: list[str] | None = None) -> list[dict[str, Any]]:
        """The newest `limit` audit rows matching every filter given, newest first, as plain dicts.

        `token` is an API token's name: its own commands and those of the tasks and undos it started
        (`requested_by` records them as `api:NAME`, `task:ID for api:NAME`, `undo:ID by api:NAME`).
        `task` is a task id or a prefix of it; `before` is a row id, the cursor of the next page.
        `devices` (a scoped token's devices) keeps only their rows; an empty list keeps none."""
        self.flush()
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
        with self._lock:
            rows = self._conn.execute(query + " ORDER BY id DESC LIMIT ?", (*params, int(limit))).fetchall()
        return [dict(r) for r in rows]


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
