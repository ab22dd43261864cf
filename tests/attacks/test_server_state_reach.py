"""A command on a device that runs on the server's own machine, reaching for the approver's channel (red team of
"an agent never approves", docs/security/approvals-red-team.md).

The server's database holds the API tokens (by hash), the audit log and the tasks. A device's sandbox hides the
device's own state directory, and the default one both share, but a server started with `--state-dir`/`--db`
elsewhere (here: under the test's directory, a write root of the device) kept its database writable to
commands: an agent's command inserted a token row of its own with `admin` and `approve`, and the sandbox applied
the changed file (and deleted the WAL): a person's token the agent knows, live at the server's next start, and
the audit rolled back. Now `server.db` and its companions are protected paths: the write is held for a person.

A real `tether server` and `tether device`, an agent's token made through the API, a real Python program run
in the device's sandbox, and the database as the server's next start would read it.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import httpx
import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import Cluster

MINTED = "tapi_minted_by_the_agent_" + "x" * 20
MINT = """import hashlib, json, sqlite3, sys, time
db = sqlite3.connect(sys.argv[1])
db.execute("INSERT INTO tokens (id, kind, name, scopes, hash, created_at, confirm, scope_devices, scope_tags, agent) "
           "VALUES (?, 'api', 'minted', ?, ?, ?, 'never', '[]', '[]', 0)",
           ("e0e0e0e0e0e0", json.dumps(["admin", "approve"]), hashlib.sha256(sys.argv[2].encode()).hexdigest(),
            time.time()))
db.commit()
print("minted")
"""


def test_a_command_cannot_mint_itself_a_token_in_the_servers_database(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # the attack is on the database file a SQLite server keeps on this machine: in the PostgreSQL pass too
    monkeypatch.setenv(dbkit.MODE_ENV, "sqlite")
    cluster = Cluster(tmp_path)
    try:
        device = cluster.device("alpha")
        cluster.wait_online("alpha", device)
        base = f"http://127.0.0.1:{cluster.port}/api/v1"
        admin = {"Authorization": f"Bearer {cluster.api_token}"}
        made = httpx.post(f"{base}/tokens", headers=admin, timeout=30,
                          json={"kind": "api", "name": "robot", "agent": True, "scopes": ["read", "execute"]})
        assert made.status_code == 201, made.text
        robot = {"Authorization": f"Bearer {made.json()['token']}"}
        script = tmp_path / "mint.py"

        def run(command: dict[str, object]) -> dict[str, object]:
            sent = httpx.post(f"{base}/devices/alpha/commands", headers=robot, json={"commands": [command]},
                              timeout=120)
            assert sent.status_code == 200, sent.text
            [result] = sent.json()["results"]
            return dict(result)

        written = run({"tool_name": "write_file", "parameters": {"file_path": str(script), "content": MINT}})
        assert written["status"] == "success", written
        minted = run({"tool_name": "shell.run", "parameters": {
            "cmd": "python3", "argv": [str(script), str(cluster.db), MINTED], "cwd": str(tmp_path)}})
        assert minted["status"] == "failure" and "protected-path: server.db" in str(minted["error"]), minted
        assert "nothing was applied" in str(minted["error"]), minted
    finally:
        cluster.close()
    digest = hashlib.sha256(MINTED.encode()).hexdigest()
    with sqlite3.connect(cluster.db) as db:  # the server stopped: what its next start would find
        assert db.execute("SELECT count(*) FROM tokens WHERE hash = ?", (digest,)).fetchone()[0] == 0
        assert db.execute("SELECT count(*) FROM tokens WHERE name = 'robot'").fetchone()[0] == 1
