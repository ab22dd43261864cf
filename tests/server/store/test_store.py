"""The server's SQLite store: hashed tokens, scopes, revocation, known devices, the audit log; settings."""

from __future__ import annotations

import sqlite3

import pytest
from pydantic import ValidationError

from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.server.store.migrations import MIGRATIONS
from tether.server.store.tokens import hash_token


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state" / "server.db")
    yield s
    s.close()


def test_tokens_are_stored_hashed_never_in_clear(store, tmp_path):
    info, secret = store.tokens.create("device", "laptop")
    assert secret.startswith("tdev_") and len(secret) > 40 and info.kind == "device" and info.scopes == []
    api_info, api_secret = store.tokens.create("api", "ops", ["execute", "read", "read"])
    assert api_secret.startswith("tapi_") and api_info.scopes == ["execute", "read"]
    raw = b"".join(p.read_bytes() for p in (tmp_path / "state").iterdir())
    assert secret.encode() not in raw and api_secret.encode() not in raw
    assert hash_token(secret).encode() in raw  # what is kept instead
    assert (tmp_path / "state" / "server.db").stat().st_mode & 0o777 == 0o600


def test_verify_and_revoke_by_id_or_name(store):
    laptop, secret = store.tokens.create("device", "laptop")
    _, rotated = store.tokens.create("device", "laptop")  # rotation: two live tokens for one device
    other, other_secret = store.tokens.create("device", "box")
    verified = store.tokens.verify(secret)
    assert verified.id == laptop.id and verified.name == "laptop" and verified.last_used_at is not None
    assert store.tokens.verify("tdev_wrong") is None and store.tokens.verify("") is None
    assert store.tokens.revoke(laptop.id) == 1
    assert store.tokens.verify(secret) is None and store.tokens.verify(rotated) is not None
    assert store.tokens.revoke("laptop") == 1 and store.tokens.revoke("laptop") == 0
    assert store.tokens.verify(rotated) is None and store.tokens.verify(other_secret).id == other.id
    listed = {t.id: t for t in store.tokens.all()}
    assert len(listed) == 3 and listed[laptop.id].revoked_at is not None and listed[other.id].active


@pytest.mark.parametrize("kind, name, scopes, error", [
    ("api", "ops", ["root"], "unknown scope(s) root"),
    ("device", "laptop", ["read"], "device tokens have no scopes"),
    ("device", "", [], "invalid token name"),
    ("device", "../etc", [], "invalid token name"),
    ("robot", "x", [], "token kind must be"),
])
def test_token_validation(store, kind, name, scopes, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        store.tokens.create(kind, name, scopes)


def test_api_scopes_and_what_they_allow(store):
    reader, _ = store.tokens.create("api", "viewer")
    assert reader.scopes == ["read"] and reader.allows("read") and not reader.allows("execute")
    runner, _ = store.tokens.create("api", "runner", ["execute"])
    assert runner.allows("read") and runner.allows("execute") and not runner.allows("admin")
    admin, _ = store.tokens.create("api", "root", ["admin"])
    assert all(admin.allows(s) for s in ("read", "execute", "admin"))
    device, _ = store.tokens.create("device", "laptop")
    assert not device.allows("read")


def test_devices_persist_and_keep_their_profile(store, tmp_path):
    store.devices.upsert("laptop", '{"os": {"platform": "linux"}}', 100.0)
    store.devices.upsert("laptop", None, 200.0)  # a disconnect: new last_seen, same profile
    [device] = store.devices.all()
    assert device.profile == {"os": {"platform": "linux"}} and device.last_seen == 200.0 and device.first_seen == 100.0
    store.close()
    reopened = Store(tmp_path / "state" / "server.db")
    assert reopened.devices.all()[0].name == "laptop" and reopened.schema_version == len(MIGRATIONS)
    reopened.close()


def test_audit_rows(store):
    store.audit.record("api:ops", "laptop", "c1", "shell.run", {"argv": ["ls"]}, "success", None, "r1")
    store.audit.record_many([("agent", "box", "c2", "files.write", {"content": "x" * 50_000}, "failure", "denied",
                              "r2")])
    newest, oldest = store.audit.rows()
    assert (newest["device"], newest["status"], newest["error"]) == ("box", "failure", "denied")
    assert "truncated" in newest["arguments"] and len(newest["arguments"]) < 17_000
    assert (oldest["requested_by"], oldest["tool_name"], oldest["call_id"], oldest["response_id"]) == (
        "api:ops", "shell.run", "c1", "r1")
    assert [r["device"] for r in store.audit.rows(device="laptop")] == ["laptop"]
    assert len(store.audit.rows(limit=1)) == 1


def test_outcomes_find_their_sent_rows_through_the_index_of_rows_in_flight(tmp_path):
    """A command's row is written `sent`, then its outcome: the outcome's UPDATE and the start-up's settling
    of rows left `sent` read only the small index of rows in flight (not a scan, not an index of the whole
    log), a row leaves that index with its outcome, and an outcome is written once."""
    db = tmp_path / "server.db"
    store = Store(db)
    rows = [("api:ops", "laptop", f"c{i}", "shell.run", {"cmd": "ls"}, "sent", None, f"r{i}", None) for i in range(3)]
    assert store.audit.sent(rows) is None
    store.audit.done([("r0", "c0", "success", None), ("r1", "c1", "failure", "boom")])
    store.audit.done([("r0", "c0", "failure", "a second outcome for the same call")])  # ignored: written once
    by_call = {r["call_id"]: r for r in store.audit.rows(device="laptop")}
    assert (by_call["c0"]["status"], by_call["c0"]["error"]) == ("success", None)
    assert (by_call["c1"]["status"], by_call["c2"]["status"]) == ("failure", "sent")
    conn = sqlite3.connect(db)
    in_flight = conn.execute("SELECT call_id FROM audit INDEXED BY audit_inflight WHERE status = 'sent'").fetchall()
    assert in_flight == [("c2",)]
    update = "UPDATE audit SET status = ?, error = ? WHERE response_id = ? AND call_id = ? AND status = 'sent'"
    plan = " ".join(str(r) for r in conn.execute("EXPLAIN QUERY PLAN " + update, ("x", None, "r", "c")))
    settle = " ".join(str(r) for r in conn.execute("EXPLAIN QUERY PLAN UPDATE audit SET status = 'unknown' "
                                                   "WHERE status = 'sent'"))
    assert "audit_inflight" in plan and "audit_inflight" in settle, (plan, settle)
    conn.close()
    store.close()
    again = Store(db)  # opening the database (any CLI command) settles nothing: a live server may own the row
    assert {r["call_id"]: r for r in again.audit.rows(device="laptop")}["c2"]["status"] == "sent"
    assert again.audit.settle_sent() == 1  # the next server, alone on the database, settles it (server/main.py)
    left = {r["call_id"]: r for r in again.audit.rows(device="laptop")}["c2"]
    assert left["status"] == "unknown" and "server stopped" in left["error"], left
    again.close()


def test_a_newer_schema_is_refused(tmp_path):
    path = tmp_path / "future.db"
    Store(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO schema_version (version) VALUES (99)")
    with pytest.raises(RuntimeError, match="schema version 99"):
        Store(path)


def test_settings_defaults_and_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_STATE_DIR", str(tmp_path))
    settings = ServerSettings()
    assert (settings.host, settings.port, settings.max_frame_bytes) == ("127.0.0.1", 8765, 8 * 1024 * 1024)
    assert settings.db_path == tmp_path / "server.db" and settings.loopback and not settings.tls
    with pytest.raises(ValidationError, match="must exceed heartbeat_interval"):
        ServerSettings(heartbeat_interval=5, heartbeat_timeout=5)
    with pytest.raises(ValidationError, match="together"):
        ServerSettings(tls_cert="cert.pem")
