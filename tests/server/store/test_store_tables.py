"""tether.server.store as tables: the Store's surface is one object per table, and SQL is written only
inside tether.server.store (no generic read/write a caller could pass a statement through)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tether.agent.tasks.cluster.ownership import TaskLeases
from tether.agent.tasks.store import TaskStore
from tether.server.store import Store
from tether.server.store.audit import AuditLog
from tether.server.store.devices import DeviceKeys, Devices
from tether.server.store.pairing import Pairing
from tether.server.store.sessions import Sessions
from tether.server.store.tokens import Tokens

SRC = Path(__file__).resolve().parents[3] / "src" / "tether"
STORE = SRC / "server" / "store"
# a string literal that starts a SQL statement
_SQL = re.compile(r"""["'](SELECT |INSERT (OR \w+ )?INTO |UPDATE \w+ SET |DELETE FROM """
                  r"""|CREATE (TABLE|INDEX|UNIQUE INDEX) |ALTER TABLE |DROP (TABLE|INDEX) |PRAGMA |BEGIN\b|COMMIT\b)""")


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "server.db")
    yield s
    s.close()


def test_the_store_is_its_tables(store: Store) -> None:
    assert isinstance(store.tokens, Tokens) and isinstance(store.devices, Devices)
    assert isinstance(store.device_keys, DeviceKeys) and isinstance(store.sessions, Sessions)
    assert isinstance(store.audit, AuditLog) and isinstance(store.pairing, Pairing)
    for generic in ("read", "write", "execute", "executemany", "conn"):
        assert not hasattr(store, generic), f"Store.{generic} would let a caller send SQL"
        for table in (store.tokens, store.devices, store.device_keys, store.sessions, store.audit, store.pairing):
            assert not hasattr(table, generic), f"{type(table).__name__}.{generic} would let a caller send SQL"


def test_the_task_store_offers_no_statement_either(tmp_path: Path) -> None:
    tasks = TaskStore(tmp_path / "tasks.db")
    try:
        for generic in ("read", "write", "execute", "execute_schema"):
            assert not hasattr(tasks, generic)
        leases = TaskLeases(tasks, "node-a", 30.0)
        assert leases.claim("t1") and leases.holder("t1") == "node-a"
        assert not TaskLeases(tasks, "node-b", 30.0).claim("t1")  # node-a holds it
        assert leases.renew(["t1"]) == set()
        leases.release("t1")
        assert leases.holder("t1") is None
    finally:
        tasks.close()


def test_no_sql_outside_the_store_package() -> None:
    found = []
    for path in SRC.rglob("*.py"):
        if STORE in path.parents:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _SQL.search(line):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert not found, "SQL belongs in tether.server.store:\n" + "\n".join(found)


def test_pairing_and_device_key_writes_go_through_the_tables(store: Store) -> None:
    store.pairing.add("ABCD-EFGH", "fp", "key", "127.0.0.1", "laptop", "linux", 1.0, 2e12)
    assert store.pairing.count_pending() == 1 and store.pairing.pending_codes("fp") == ["ABCD-EFGH"]
    info, _ = store.tokens.create("device", "laptop")
    assert store.pairing.approve("ABCD-EFGH", "laptop", "[]", info.id, "admin") == 1
    assert store.pairing.approve("ABCD-EFGH", "laptop", "[]", info.id, "admin") == 0  # no longer pending
    store.device_keys.put("laptop", "key", "pairing ABCD-EFGH by admin")
    assert [r["code"] for r in store.pairing.approved()] == ["ABCD-EFGH"]
    store.tokens.revoke_id(info.id)
    store.device_keys.forget_enrolled_by("laptop", "pairing ABCD-EFGH %")
    store.pairing.reopen("ABCD-EFGH")
    assert store.device_keys.get("laptop") is None and not store.tokens.has_active_device("laptop")
    assert store.pairing.get("ABCD-EFGH")["status"] == "pending"
