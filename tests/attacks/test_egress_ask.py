"""`ask: on-miss` (issue 26, item 4): a sandboxed command's unlisted host is put to a person while the
connection waits, through the device's question route; `always` is an audited change of the device's
network policy; deny and no answer refuse with the rule named.

Real things only: a `tether server`, a `tether device` whose policy lists `127.0.0.0/8` and asks on a miss,
an HTTP server on this machine's loopback reached by name (`localhost`, a name the list does not hold), and
`curl` run by an agent's token through `shell.run` inside the device's bubblewrap sandbox, going out
through the device's egress proxy. The agent's token tries to answer its own command's question (refused);
a person answers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import Cluster
from tests.kits.sse import sse_events
from tests.kits.upstream import start_upstream

BODY = b"hello from the unlisted host\n"


class Egress:
    """The server, device `alpha` (network: allow 127.0.0.0/8, ask: on-miss) and tokens: `robot` (an agent's,
    read + execute) and `bob` (a person's, approve)."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        curl = shutil.which("curl")
        if curl is None:
            pytest.fail("curl is not installed; install it with: apt-get install -y curl")
        self.curl = curl
        self.cluster = cluster
        self.upstream = start_upstream(BODY)
        self.url = f"http://localhost:{self.upstream.server_address[1]}/"
        policy = tmp / "policy.yaml"
        policy.write_text(json.dumps({"commands": {"curl": {}},
                                      "network": {"allow": ["127.0.0.0/8"], "ask": "on-miss"}}))
        self.policy = policy
        self.proc = cluster.device("alpha", extra=("--policy", str(policy)))
        cluster.wait_online("alpha", self.proc)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{cluster.port}/api/v1", timeout=60)
        self.secrets: dict[str, str] = {}
        for name, scopes, agent in (("robot", ["read", "execute"], True),
                                    ("bob", ["read", "execute", "approve"], False)):
            made = self.http.post("/tokens", json={"kind": "api", "name": name, "scopes": scopes, "agent": agent},
                                  headers={"Authorization": f"Bearer {cluster.api_token}"})
            assert made.status_code == 201, made.text
            self.secrets[name] = made.json()["token"]

    def auth(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secrets[who]}"}

    def fetch(self, answers: list[tuple[str, dict[str, Any] | None, int] | Callable[[], None]],
              timeout_ms: int = 60_000) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """robot runs `curl URL` on alpha; at each question the (who, content, status) answers are tried in
        order (None content: a decline), a callable in the list run where it stands. The questions asked and
        the command's result."""
        body = {"commands": [{"tool_name": "shell.run", "parameters": {
            "cmd": self.curl, "argv": ["-sS", "--max-time", "120", self.url], "cwd": "/tmp",
            "timeoutMs": timeout_ms}}], "timeout": 120}
        questions: list[dict[str, Any]] = []
        result: dict[str, Any] = {}
        with self.http.stream("POST", "/devices/alpha/commands", json=body,
                              headers={**self.auth("robot"), "Accept": "text/event-stream"}) as response:
            assert response.status_code == 200, response.read()
            for kind, event in sse_events(response.iter_lines()):
                if kind == "event":
                    if event["kind"] != "elicitation":
                        continue
                    questions.append(event["data"])
                    for answer in answers:
                        if callable(answer):
                            answer()
                            continue
                        who, content, status = answer
                        tried = self.http.post(f"/devices/alpha/questions/{event['data']['id']}",
                                               json={"action": "accept" if content else "decline",
                                                     "content": content}, headers=self.auth(who))
                        assert tried.status_code == status, (who, tried.status_code, tried.text)
                        if status >= 400:
                            assert set(tried.json()) == {"error"}, tried.text
                elif kind == "results":
                    [result] = event["results"]
                    break
        return questions, result

    def restart(self) -> None:
        """Stop device alpha and start it again on the same state directory and policy file."""
        self.proc.stop()
        self.proc = self.cluster.device("alpha", extra=("--policy", str(self.policy)))
        self.cluster.wait_online("alpha", self.proc)

    def close(self) -> None:
        self.http.close()
        self.upstream.shutdown()
        self.upstream.server_close()


@pytest.fixture(scope="module")
def egress(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Egress]:
    tmp = tmp_path_factory.mktemp("egress-ask")
    cluster = Cluster(tmp)
    try:
        e = Egress(cluster, tmp)
        yield e
        e.close()
    finally:
        cluster.close()


def _stdout(result: dict[str, Any]) -> str:
    return str((result.get("result") or {}).get("stdout", ""))


def test_an_unlisted_host_waits_for_a_person_and_once_opens_it(egress: Egress) -> None:
    # the agent that ran the command cannot answer its question; a person's "once" opens this connection
    questions, result = egress.fetch([("robot", {"answer": "once"}, 403), ("bob", {"answer": "once"}, 200)])
    [asked] = questions
    assert asked["egress"]["host"] == "localhost" and asked["asker"] == "robot" and asked["approval"] is True
    assert asked["schema"]["properties"]["answer"]["enum"] == ["once", "always", "deny"]
    assert _stdout(result) == BODY.decode(), result
    assert any("network.ask: once" in note for note in result["result"]["notes"]), result


def test_deny_refuses_with_the_rule_named(egress: Egress) -> None:
    questions, result = egress.fetch([("bob", {"answer": "deny"}, 200)])
    assert len(questions) == 1
    assert '"rule": "network.ask: deny"' in _stdout(result), result
    assert BODY.decode() not in _stdout(result)


def test_a_decline_is_a_deny(egress: Egress) -> None:
    _, result = egress.fetch([("bob", None, 200)])
    assert '"rule": "network.ask: deny"' in _stdout(result), result


def test_no_answer_in_the_commands_time_refuses_naming_network_ask(egress: Egress) -> None:
    # nobody answers: the wait ends a second before the command's own 4 s timeout, and curl is refused
    questions, result = egress.fetch([], timeout_ms=4000)
    assert len(questions) == 1
    assert result["status"] == "success", result
    assert '"rule": "network.ask"' in _stdout(result) and "nobody answered within" in _stdout(result), result


REFUSAL = "the audit log refuses network rows (the fault this test puts at the store)"
SQLITE_REFUSE = ("CREATE TRIGGER refuse_network BEFORE INSERT ON audit WHEN NEW.tool_name LIKE 'network.%' "
                 f"BEGIN SELECT RAISE(ABORT, '{REFUSAL}'); END;")
PG_REFUSE = ("CREATE FUNCTION refuse_network() RETURNS trigger LANGUAGE plpgsql AS "
             f"$$ BEGIN RAISE EXCEPTION '{REFUSAL}'; END $$; "
             "CREATE TRIGGER refuse_network BEFORE INSERT ON audit FOR EACH ROW "
             "WHEN (NEW.tool_name LIKE 'network.%') EXECUTE FUNCTION refuse_network();")
SQLITE_ALLOW = "DROP TRIGGER refuse_network;"
PG_ALLOW = "DROP TRIGGER refuse_network ON audit; DROP FUNCTION refuse_network();"


def _on_db(egress: Egress, sqlite_sql: str, pg_sql: str) -> None:
    """A statement on the server's database, as another client of it would run it."""
    import contextlib
    import sqlite3

    target = dbkit.server_db(egress.cluster.db)
    if isinstance(target, Path):
        with contextlib.closing(sqlite3.connect(target, timeout=60)) as conn:
            conn.executescript(sqlite_sql)
    else:
        dbkit.psql(str(target), pg_sql)


def _network_rows(egress: Egress) -> list[dict[str, Any]]:
    audit = egress.http.get("/audit", params={"device": "alpha", "limit": 500},
                            headers={"Authorization": f"Bearer {egress.cluster.api_token}"}).json()
    rows = audit if isinstance(audit, list) else audit.get("rows", audit.get("entries", []))
    return [r for r in rows if str(r["tool_name"]).startswith("network.")]


def test_an_answer_the_audit_cannot_record_does_not_reach_the_device(egress: Egress) -> None:
    """A person's network decision is recorded before the device acts on it: while the audit log refuses the
    row, the answer is refused (503, {"error"}), nothing reaches the device and the question still waits; the
    same answer once the log takes rows again goes through, recorded once, with who gave it."""
    before = _network_rows(egress)
    _on_db(egress, SQLITE_REFUSE, PG_REFUSE)
    allowed: list[bool] = []

    def allow() -> None:
        _on_db(egress, SQLITE_ALLOW, PG_ALLOW)
        allowed.append(True)

    try:
        questions, result = egress.fetch([("bob", {"answer": "once"}, 503), allow, ("bob", {"answer": "once"}, 200)])
    finally:
        if not allowed:
            allow()
    assert len(questions) == 1 and _stdout(result) == BODY.decode(), result
    new = [r for r in _network_rows(egress) if r not in before]
    assert len(new) == 1, new
    assert new[0]["tool_name"] == "network.ask" and new[0]["requested_by"] == "api:bob", new
    arguments = new[0]["arguments"]
    assert (json.loads(arguments) if isinstance(arguments, str) else arguments)["answer"] == "once", new


def test_always_adds_the_host_to_the_policy_as_an_audited_change(egress: Egress) -> None:
    questions, result = egress.fetch([("bob", {"answer": "always"}, 200)])
    assert len(questions) == 1 and _stdout(result) == BODY.decode(), result
    again, result = egress.fetch([])  # listed now: no question
    assert again == [] and _stdout(result) == BODY.decode(), result
    host = egress.url.removeprefix("http://").rstrip("/")
    shown = egress.http.get("/devices/alpha/policy", headers={"Authorization": f"Bearer {egress.cluster.api_token}"})
    assert shown.status_code == 200 and host in json.dumps(shown.json()), shown.text
    audit = egress.http.get("/audit", params={"device": "alpha", "limit": 200},
                            headers={"Authorization": f"Bearer {egress.cluster.api_token}"}).json()
    rows = audit if isinstance(audit, list) else audit.get("rows", audit.get("entries", []))
    changes = [r for r in rows if r["tool_name"] == "network.allow"]
    assert len(changes) == 1 and changes[0]["requested_by"] == "api:bob", changes
    assert "always" in json.dumps(changes[0]) and "localhost" in json.dumps(changes[0]), changes
    # kept in the device's state directory (0600): back after a restart, with the question the server's
    # audit ties to the person who answered it; the policy file itself is untouched
    kept = egress.cluster.state / "dev-alpha" / "egress-grants.json"
    assert kept.stat().st_mode & 0o777 == 0o600
    [grant] = json.loads(kept.read_text())["grants"]
    assert grant["entry"] == host and grant["question"] == questions[0]["id"], grant
    assert host not in egress.policy.read_text()
    egress.restart()
    again, result = egress.fetch([])
    assert again == [] and _stdout(result) == BODY.decode(), result
