"""tether.server.store.lease on SQLite, in one process: real `flock`s on the lock files beside a database
(open file descriptions conflict within a process as between processes). The processes' side — a second
`tether server`, kill -9, PostgreSQL — is tests/chaos/test_one_server_per_state.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tether.server.store import Store
from tether.server.store.lease import StateBusy, take_lease


def test_one_lease_per_node_and_only_a_server_alone_may_settle(tmp_path: Path) -> None:
    db = tmp_path / "state" / "server.db"
    first = take_lease(db, "host:abc", host="127.0.0.1", port=8765)
    assert first.alone
    with pytest.raises(StateBusy) as refused:
        take_lease(db, "host:abc", port=9999)
    assert str(refused.value) == (
        f"another tether server (pid {os.getpid()}, listening on 127.0.0.1:8765) already serves this state ({db}, "
        "node host:abc); stop it first, or start this one as another node (--node-id NAME, or a state directory "
        "of its own)")
    first.announce("0.0.0.0", 8800)  # where it listens once bound (port 0 given: the port it got)
    with pytest.raises(StateBusy, match=r"listening on 0\.0\.0\.0:8800"):
        take_lease(db, "host:abc")
    first.settled()  # recovery done: the database is shared from now on (until then another node waits)
    with pytest.raises(StateBusy, match=r"node id n1 is already taken by .*give each node its own --node-id"):
        other = take_lease(db, "n1", port=1, default_node=False)
        try:
            take_lease(db, "n1", port=2, default_node=False)
        finally:
            other.release()
    second = take_lease(db, "another-node")
    assert not second.alone  # another server is live: its rows in flight are not this one's to settle
    first.release()
    second.release()
    again = take_lease(db, "host:abc")  # nothing stale: the locks went with their descriptors
    assert again.alone
    again.release()
    assert sorted(p.name for p in db.parent.iterdir()) == sorted(
        ["server.db.lock", *(f"server.db.node-{d}.lock" for d in _digests("host:abc", "n1", "another-node"))])


def test_opening_the_database_settles_nothing_a_server_alone_does(tmp_path: Path) -> None:
    db = tmp_path / "server.db"
    store = Store(db)
    store.audit.sent([("api:ops", "laptop", "c1", "shell.run", {"cmd": "ls"}, "sent", None, "r1", None)])
    store.close()
    reader = Store(db)  # `tether audit`, `tether token create`: a live server may still hear this row's result
    assert [r["status"] for r in reader.audit.rows()] == ["sent"]
    assert reader.audit.settle_sent() == 1 and [r["status"] for r in reader.audit.rows()] == ["unknown"]
    reader.close()


def _digests(*nodes: str) -> list[str]:
    from tether.server.store.lease import node_digest

    return [node_digest(n) for n in nodes]
