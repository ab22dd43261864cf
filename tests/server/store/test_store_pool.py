"""The other tables' statements off the event loop with PostgreSQL (docs/database.md): `Store.call` runs a
table's method on the store's pool, each thread with a session of its own, so a lock on one table holds only
the statements on it; a token verified before is answered from memory. With SQLite `call` runs at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import wait_for
from tether.server.store import Store, pool


def test_sqlite_calls_run_at_once_on_the_caller(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    try:
        _, secret = store.tokens.create("api", "ops", ["read"])

        async def scenario() -> None:
            assert store.calls is None
            assert (await store.call(store.devices.known, "x")) is False
            info = await store.tokens.check(secret)
            assert info is not None and info.name == "ops"
            assert store.stalled() is None

        asyncio.run(scenario())
    finally:
        store.close()


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with dbkit.fresh_postgres_database("pool") as url:
        yield url


def test_a_locked_tokens_table_holds_only_the_lookups_that_need_it(pg_url: str, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    import psycopg

    monkeypatch.setattr(pool, "STALL_S", 0.0)  # any statement still waiting counts as stalled
    store = Store(pg_url)
    locker = psycopg.connect(pg_url)
    watcher = psycopg.connect(pg_url, autocommit=True)
    try:
        known, known_secret = store.tokens.create("api", "known", ["read"])
        stranger, stranger_secret = store.tokens.create("api", "stranger", ["read"])

        async def scenario() -> None:
            first = await store.tokens.check(known_secret)  # looked up once: known from then on
            assert first is not None and first.id == known.id
            locker.execute("LOCK TABLE tokens IN ACCESS EXCLUSIVE MODE")
            waiting = asyncio.ensure_future(store.tokens.check(stranger_secret))
            await asyncio.to_thread(wait_for, lambda: watcher.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'tokens'::regclass").fetchone()[0] > 0,
                "the new token's lookup waiting on the lock", 10)
            started = time.monotonic()
            again = await store.tokens.check(known_secret)  # from memory
            assert again is not None and again.id == known.id
            assert await store.call(store.devices.known, "laptop") is False  # another table, another session
            assert time.monotonic() - started < 1.0
            assert not waiting.done()
            assert "(Tokens.verify) has waited" in (store.stalled() or ""), store.stalled()
            locker.rollback()
            found = await asyncio.wait_for(waiting, 10)
            assert found is not None and found.id == stranger.id
            assert store.stalled() is None

        asyncio.run(scenario())
    finally:
        locker.close()
        watcher.close()
        store.close()


def test_writes_behind_the_caller_run_in_order_and_a_call_in_order_after_them(pg_url: str) -> None:
    store = Store(pg_url)
    try:
        async def scenario() -> None:
            for seen in (1.0, 2.0, 3.0):
                store.soon(store.devices.upsert, "laptop", None, seen)
            store.soon(store.devices.forget, "laptop")
            assert await store.call(store.devices.known, "laptop", in_order=True) is False
            store.soon(store.devices.upsert, "laptop", None, 4.0)
            heads = await store.call(store.devices.heads, in_order=True)
            assert [(h[0], h[1]) for h in heads] == [("laptop", 4.0)]

        asyncio.run(scenario())
    finally:
        store.close()
