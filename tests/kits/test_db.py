"""tests/kits/db.py itself: the per-test PostgreSQL databases the server suite's second pass runs on are
created from the template, kept apart per state path, and dropped when the test ends; SQLite mode is
the path, unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kits import db as dbkit


@pytest.fixture(scope="module")
def admin() -> Iterator[str]:
    # the template without the server's migrations: this tests the kit, not the Store
    with dbkit.postgres_session(migrated=False) as url:
        yield url


def databases(admin: str) -> set[str]:
    return set(dbkit.psql(admin, "SELECT datname FROM pg_database WHERE NOT datistemplate").split())


def test_sqlite_mode_is_the_path_and_tokens_land_in_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.server.store import Store

    monkeypatch.delenv(dbkit.MODE_ENV, raising=False)
    assert dbkit.server_db(tmp_path / "server.db") == tmp_path / "server.db"
    assert dbkit.server_db_args(str(tmp_path / "x.db")) == ["--db", str(tmp_path / "x.db")]
    secrets = dbkit.create_tokens(tmp_path / "server.db", [("api", "a", ["read"]), ("device", "alpha", [])])
    assert len(set(secrets)) == 2
    store = Store(str(tmp_path / "server.db"))
    try:
        assert {t.name for t in store.tokens.all()} == {"a", "alpha"}
        assert store.tokens.verify(secrets[0]) is not None
    finally:
        store.close()


def test_a_misspelt_mode_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dbkit.MODE_ENV, "postgresql")
    with pytest.raises(RuntimeError, match="expected 'sqlite' or 'postgres'"):
        dbkit.backend()


@pytest.fixture
def outside(monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL mode with no scope open (also when this file runs in the PostgreSQL pass itself)."""
    monkeypatch.setenv(dbkit.MODE_ENV, "postgres")
    for key in (dbkit.ADMIN_ENV, dbkit.PREFIX_ENV, dbkit.USED_ENV):
        monkeypatch.delenv(key, raising=False)


def test_each_state_path_is_its_own_database_dropped_after(admin: str, tmp_path: Path, outside: None) -> None:
    before = databases(admin)
    with dbkit.per_test_databases(admin) as prefix:
        first = dbkit.server_db(tmp_path / "server0.db")
        again = dbkit.server_db(tmp_path / "server0.db")  # a restart on the same path finds its state
        other = dbkit.server_db(tmp_path / "server1.db")
        assert isinstance(first, str) and first.startswith("postgresql://tether@127.0.0.1:")
        assert first == again and first != other
        assert dbkit.server_db_args(tmp_path / "server1.db") == ["--db", other]
        dbkit.psql(str(first), "CREATE TABLE kept (x int); INSERT INTO kept VALUES (7)")
        assert dbkit.psql(str(again), "SELECT x FROM kept").strip() == "7"
        assert dbkit.psql(str(other), "SELECT count(*) FROM pg_tables WHERE tablename = 'kept'").strip() == "0"
        made = databases(admin) - before
        assert len(made) == 2 and all(name.startswith(prefix) for name in made)
    assert databases(admin) == before
    with pytest.raises(RuntimeError, match="outside a test session"):
        dbkit.server_db(tmp_path / "server0.db")


def test_a_module_fixtures_database_lives_through_the_tests_that_share_it(admin: str, tmp_path: Path,
                                                                          outside: None) -> None:
    before = databases(admin)
    with dbkit.per_test_databases(admin, "s") as session:
        shared = dbkit.server_db(tmp_path / "module.db")  # a module-scoped server, before any test's scope
        for _ in range(2):
            with dbkit.per_test_databases(admin) as test:
                assert dbkit.server_db(tmp_path / "module.db") == shared  # restarting it finds its state
                own = str(dbkit.server_db(tmp_path / "own.db"))
                assert own.rsplit("/", 1)[1].startswith(test)
            assert own.rsplit("/", 1)[1] not in databases(admin)
        assert str(shared).rsplit("/", 1)[1].startswith(session) and databases(admin) - before == {
            str(shared).rsplit("/", 1)[1]}
    assert databases(admin) == before


def test_a_server_left_connected_does_not_keep_its_database(admin: str, tmp_path: Path, outside: None) -> None:
    import subprocess

    from bench.kit.engines import _postgres_bin

    before = databases(admin)
    with dbkit.per_test_databases(admin):
        url = str(dbkit.server_db(tmp_path / "server.db"))
        # a client that holds a session open, as a server a failed test left running would
        holder = subprocess.Popen([_postgres_bin("psql"), url, "-X", "-q"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("SELECT 'connected';\n")
        holder.stdin.flush()
        assert "connected" in holder.stdout.readline() + holder.stdout.readline() + holder.stdout.readline()
    try:
        assert databases(admin) == before
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_the_postgres_pass_selects_the_tests_that_start_servers_through_a_testkit() -> None:
    import types

    class Item:
        def __init__(self, module: types.ModuleType) -> None:
            self.module = module
            self._fixtureinfo = None

    @dbkit.keeps_server_state
    class Server: ...

    def helper() -> None: ...

    server_side, by_hand = types.ModuleType("test_server_side"), types.ModuleType("test_by_hand")
    unrelated = types.ModuleType("test_unrelated")
    server_side.Server = Server  # type: ignore[attr-defined]
    by_hand.dbkit = dbkit  # type: ignore[attr-defined]  # starts `tether server` with dbkit.server_db_args
    unrelated.helper, unrelated.Path = helper, Path  # type: ignore[attr-defined]
    assert dbkit.starts_servers(Item(server_side))
    assert dbkit.starts_servers(Item(by_hand))
    assert not dbkit.starts_servers(Item(unrelated))
