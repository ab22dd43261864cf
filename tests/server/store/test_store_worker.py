"""The audit log's statements off the event loop (docs/database.md): with PostgreSQL a group commit runs on
the store's one worker thread, so a locked audit table holds only the callers of that commit; with SQLite it
runs at once, as before. `AuditLog.health()` answers from state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits import db as dbkit
from tether.server.store import Store
from tether.server.store.engine import Ran


def row(call_id: str, response_id: str) -> tuple[object, ...]:
    return ("api:t", "alpha", call_id, "noop", {}, "sent", None, response_id)


def test_ran_gives_the_value_or_raises_the_error() -> None:
    assert Ran(lambda: 3).result() == 3 and Ran(lambda: 3).done()

    def boom() -> int:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        Ran(boom).result()


def test_sqlite_group_commit_runs_at_once_on_the_loop(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    try:
        assert store._engine.offload is False and store._engine.audit_conn is store._engine.conn

        async def scenario() -> None:
            written = store.audit.sent_grouped([row("c1", "r1")])
            assert await written is None
            await store.audit.done_grouped([("r1", "c1", "success", None)])
            assert store.audit.health() is None

        asyncio.run(scenario())
        assert [(r["call_id"], r["status"]) for r in store.audit.rows()] == [("c1", "success")]
        assert not store._engine.worker._threads  # no thread was started for SQLite
    finally:
        store.close()


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with dbkit.fresh_postgres_database("worker") as url:
        yield url


def test_postgres_group_commit_waits_for_a_lock_on_the_worker_not_on_the_loop(pg_url: str) -> None:
    import psycopg

    store = Store(pg_url)
    try:
        assert store._engine.offload is True and store._engine.audit_conn is not store._engine.conn
        locker = psycopg.connect(pg_url)
        locker.execute("LOCK TABLE audit IN ACCESS EXCLUSIVE MODE")

        async def scenario() -> None:
            first = store.audit.sent_grouped([row("c1", "r1")])
            await asyncio.sleep(0)  # the next turn: a second group, queued behind the first on the worker
            done = store.audit.done_grouped([("r1", "c1", "success", None)])
            second = store.audit.sent_grouped([row("c2", "r2")])
            # the loop keeps turning while both wait on the lock: 20 short turns take ~20 ms, not the lock
            started = time.monotonic()
            for _ in range(20):
                await asyncio.sleep(0)
            assert time.monotonic() - started < 1.0
            assert not first.done() and not second.done() and not done.done()
            assert store.audit.health() is None or "did not answer" in (store.audit.health() or "")
            await asyncio.to_thread(locker.rollback)
            assert await asyncio.wait_for(first, 10) is None
            await asyncio.wait_for(done, 10)
            assert await asyncio.wait_for(second, 10) is None

        asyncio.run(scenario())
        locker.close()
        # written in the order the groups were formed: c1's outcome after its row, then c2
        assert [(r["call_id"], r["status"]) for r in reversed(store.audit.rows())] == \
            [("c1", "success"), ("c2", "sent")]
    finally:
        store.close()


def test_postgres_rows_written_after_their_callers_gave_up_say_they_were_not_sent(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from tether.server.store.audit import group

    monkeypatch.setattr(group, "GROUP_TIMEOUT_S", 0.2)
    store = Store(pg_url)
    try:
        locker = psycopg.connect(pg_url)
        locker.execute("LOCK TABLE audit IN ACCESS EXCLUSIVE MODE")

        async def scenario() -> None:
            problem = await asyncio.wait_for(store.audit.sent_grouped([row("c9", "r9")]), 10)
            assert problem is not None and "did not answer within 0.2s" in problem, problem
            await asyncio.to_thread(locker.rollback)
            async with asyncio.timeout(120):  # the late write, then the outcome it queued, settle on the worker
                while not ((rows := await asyncio.to_thread(store.audit.rows)) and rows[0]["status"] != "sent"):
                    # everything queued on the worker so far has run (it runs in order): then look again
                    await asyncio.to_thread(store._engine.run_sync, lambda: None)

        asyncio.run(scenario())
        locker.close()
        [written] = [r for r in store.audit.rows() if r["call_id"] == "c9"]
        assert written["status"] == "failure" and written["error"].startswith("not sent: "), written
    finally:
        store.close()


def test_postgres_groups_formed_behind_a_slow_one_go_as_one_and_give_up_unwritten(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import psycopg

    from tether.server.store.audit import group

    store = Store(pg_url)
    try:
        locker = psycopg.connect(pg_url)
        locker.execute("LOCK TABLE audit IN ACCESS EXCLUSIVE MODE")
        handed: list[object] = []
        submit = store._engine.submit
        monkeypatch.setattr(store._engine, "submit", lambda fn: (  # the group commits handed to the worker
            handed.append(fn) if fn.__qualname__.startswith("GroupCommit._group_commit") else None) or submit(fn))

        async def scenario() -> None:
            first = store.audit.sent_grouped([row("g1", "q1")])
            await asyncio.sleep(0)  # on the worker, waiting for the lock
            handed_then = len(handed)
            later = []
            for i in range(3):  # three more turns, three more groups: they wait as one
                later.append(store.audit.sent_grouped([row(f"g{i + 2}", f"q{i + 2}")]))
                await asyncio.sleep(0)
            assert len(handed) == handed_then and not any(f.done() for f in [first, *later])
            await asyncio.to_thread(locker.rollback)
            assert await asyncio.wait_for(first, 10) is None
            assert await asyncio.wait_for(asyncio.gather(*later), 10) == [None, None, None]
            assert len(handed) - handed_then == 1  # the three in one group commit

            monkeypatch.setattr(group, "GROUP_TIMEOUT_S", 0.2)
            await asyncio.to_thread(locker.execute, "LOCK TABLE audit IN ACCESS EXCLUSIVE MODE")
            stuck = store.audit.sent_grouped([row("s1", "t1")])
            await asyncio.sleep(0)
            behind = store.audit.sent_grouped([row("s2", "t2")])
            # the group behind the stuck one is told in time, and its row is never handed over
            assert "did not answer within 0.2s" in (await asyncio.wait_for(behind, 10) or "")
            assert "did not answer within 0.2s" in (await asyncio.wait_for(stuck, 10) or "")
            await asyncio.to_thread(locker.rollback)

        asyncio.run(scenario())
        locker.close()
        rows = {r["call_id"]: r for r in store.audit.rows()}
        assert [rows[f"g{i}"]["status"] for i in range(1, 5)] == ["sent"] * 4
        assert "s2" not in rows  # its command was never sent: no row says it was
    finally:
        store.close()


def test_postgres_statements_run_together_are_written_all_or_none(pg_url: str) -> None:
    """`execute_together` (one round trip, how a group commit is written): a failing statement leaves nothing of
    the others written, and the session goes on."""
    import sqlite3

    from tether.server.store.engine import PostgresConnection

    conn = PostgresConnection(pg_url)
    try:
        conn.execute("CREATE TABLE together (k TEXT PRIMARY KEY, v TEXT)")
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute_together([("INSERT INTO together (k, v) VALUES (?, ?)", [("a", "1"), ("b", "1")]),
                                   ("INSERT INTO together (k, v) VALUES (?, ?)", [("a", "2")])])
        assert conn.execute("SELECT k FROM together").fetchall() == []
        conn.execute_together([("INSERT INTO together (k, v) VALUES (?, ?)", [("a", "1"), ("b", "1")]),
                               ("UPDATE together SET v = ? WHERE k = ?", [("2", "a")]),
                               ("DELETE FROM together WHERE k = ?", [])])  # no rows: left out
        assert sorted(tuple(r) for r in conn.execute("SELECT k, v FROM together").fetchall()) == \
            [("a", "2"), ("b", "1")]
        assert not conn.in_transaction
    finally:
        conn.close()
