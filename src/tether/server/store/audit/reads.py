"""`AuditReads`: reading the `audit` table (`rows`, `batch`, `response_of`) and settling rows after the fact
(`late`, `restarted`). Reads write what is held first; the `read_*` forms await the worker instead of holding
the event loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tether.server.store.audit.table import LATE_NOTE, _call_soon
from tether.server.store.audit.writes import AuditWrites

logger = logging.getLogger(__package__)  # the audit log's one logger, whichever of its modules logs

_BATCH_WINDOW = 200_000  # GET /batches/{id} looks for a batch's rows among the newest this many audit rows


class AuditReads(AuditWrites):
    """Reads of the log and the late settling of its rows (see the module's docstring)."""

    def late(self, device: str, outcomes: list[tuple[str, str, str, str | None]],
             then: Callable[[int], None] | None = None) -> int | None:
        """Settle rows with an outcome that came back after the caller's wait ended: (response_id, call_id,
        status, error) from `device`. Only a row of that device, that batch and that call whose outcome is
        not known yet (`sent`, `pending`, `unknown`) changes — an outcome is written once, and a device
        cannot settle another's rows; its error gets `LATE_NOTE`. Written now (a late result is rare and
        must not wait for a caller that is gone): how many rows changed, also given to `then`. On an event
        loop with PostgreSQL it is handed to the worker (after the rows held back) without waiting: it returns
        None and `then(count)` is called on the loop once written (a write that fails is logged, count 0)."""
        loop = self._offloaded_loop()
        if loop is None:
            self.flush()  # the `sent` rows and outcomes held back go first
            count = self._engine.run_sync(lambda: self._late(device, outcomes))
            if then is not None:
                then(count)
            return count
        self._flush_soon()  # handed to the worker first: it runs in order

        def settled(future: Future[int]) -> None:
            try:
                count = future.result()
            except Exception as exc:
                logger.error("could not record %d late outcome(s) of device %s: %s", len(outcomes), device, exc)
                count = 0
            if then is not None:
                then(count)

        try:
            self._engine.worker.submit(lambda: self._late(device, outcomes)).add_done_callback(
                lambda f: _call_soon(loop, settled, f))
        except RuntimeError as exc:  # the store is closed
            logger.error("could not record %d late outcome(s) of device %s: %s", len(outcomes), device, exc)
        return None

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
        row has it. What a node taking over a task needs to ask the device about the step in flight. On an
        event loop use `read_response_of`."""
        self.flush()
        row = self._engine.run_sync(self._response_work(device, call_id))
        return str(row[0]) if row is not None and row[0] else None

    async def read_response_of(self, device: str, call_id: str) -> str | None:
        """`response_of` awaited on the worker, after the rows held back: the event loop never waits."""
        if self._offloaded_loop() is None:
            return self.response_of(device, call_id)
        self._flush_soon()
        row = await self._on_worker(self._response_work(device, call_id))
        return str(row[0]) if row is not None and row[0] else None

    def _response_work(self, device: str, call_id: str) -> Callable[[], Any]:
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

        return work

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


def _like(text: str) -> str:
    """`text` with LIKE's wildcards escaped, so a name is matched as written."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
