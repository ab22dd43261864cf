"""Issue 10, items 1 and 2, as an attacker tries them against a real `tether server` and a real
`tether device` process: approval through a task's undo with an execute token, writing into another
caller's (or a task's) undo session, and result replay through a caller-chosen call_id.

The device is jailed to two folders and runs with its own temp directory, so deleting in `temp`
needs no approval while overwriting in `root` does. Each attacker holds an API token of their own,
made through the API the way an admin would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits.netutil import Cluster, wait_for
from tether.protocol.models import Command

PRIVATE = "alice's quarterly numbers: 42"


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "root"
        device_temp = tmp / "device-temp"
        # where the sessions meet: a directory in the device's temp dir (no approval to overwrite there) that
        # the policy names as a write root, so it is the machine's, shared and captured; the rest of the
        # temp dir is each session's private /tmp
        self.temp = device_temp / "shared"
        self.root.mkdir()
        self.temp.mkdir(parents=True)
        policy = tmp / "policy.yaml"
        roots = json.dumps([str(self.root), str(device_temp), str(self.temp)])
        policy.write_text(f"read_roots: {roots}\nwrite_roots: {roots}\n")
        self.cluster = Cluster(tmp)
        self.alpha = self.cluster.device("alpha", extra=("--policy", str(policy)), env={"TMPDIR": str(device_temp)})
        self.cluster.wait_online("alpha", self.alpha)
        self.base = f"http://127.0.0.1:{self.cluster.port}/api/v1"
        self.admin = self.client(self.cluster.api_token)
        self.alice = self.client(self.token("alice", ["execute"]))
        self.bob = self.client(self.token("bob", ["execute"]))  # an agent: may run commands, not approve
        self.mallory = self.client(self.token("mallory", ["execute", "approve"]))  # a person, but not alice
        self.carol = self.client(self.token("carol", ["execute", "approve"]))  # the approver of alice's tasks

    def token(self, name: str, scopes: list[str]) -> str:
        made = httpx.post(f"{self.base}/tokens", json={"kind": "api", "name": name, "scopes": scopes},
                          headers={"Authorization": f"Bearer {self.cluster.api_token}"}, timeout=30)
        assert made.status_code == 201, made.text
        return made.json()["token"]

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=self.base, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def run(self, who: httpx.Client, *commands: Command, **extra: Any) -> httpx.Response:
        body = {"commands": [c.model_dump(mode="json", exclude_none=True) for c in commands], "timeout": 30, **extra}
        return who.post("/devices/alpha/commands", json=body)

    def audit(self, **match: Any) -> list[dict[str, Any]]:
        rows = self.admin.get("/audit", params={"limit": 500}).json()["rows"]
        return [r for r in rows if all(r.get(k) == v for k, v in match.items())]

    def finished(self, who: httpx.Client, task_id: str) -> dict[str, Any]:
        def ended() -> dict[str, Any] | None:
            task = who.get(f"/tasks/{task_id}").json()
            return task if task["state"] in ("done", "failed", "cancelled") else None

        return wait_for(ended, f"task {task_id} ended", 60, (self.alpha.popen,))  # type: ignore[return-value]

    def close(self) -> None:
        for client in (self.admin, self.alice, self.bob, self.mallory, self.carol):
            client.close()
        self.cluster.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    s = Setup(tmp_path_factory.mktemp("undo-replay"))
    yield s
    s.close()


def write(path: Path, content: str, **params: Any) -> Command:
    return Command(tool_name="write_file", parameters={"file_path": str(path), "content": content, **params})


def error_of(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def alices_task(setup: Setup, name: str) -> dict[str, Any]:
    """Alice runs a task that creates a file in `root`: its change is journaled in the task's session."""
    step = {"skill": "write_file", "args": {"file_path": str(setup.root / name), "content": "alice's work"}}
    created = setup.alice.post("/tasks", json={"device": "alpha", "plan": [step]})
    assert created.status_code == 201, created.text
    task = setup.finished(setup.alice, created.json()["id"])
    assert task["state"] == "done", task["error"]
    return task


# -- item 1: approval through undo -----------------------------------------------------------------

def test_undo_needs_the_approve_scope(setup: Setup) -> None:
    task = alices_task(setup, "report.txt")
    refused = setup.bob.post(f"/tasks/{task['id']}/undo")
    assert refused.status_code == 403
    assert "lacks the 'approve' scope needed to undo a task" in error_of(refused)
    assert (setup.root / "report.txt").read_text() == "alice's work"  # nothing was undone
    assert not [r for r in setup.audit(tool_name="undo_session") if task["id"] in r["arguments"]]  # never sent
    # the task's approver may: the undo runs on the device as an approved action in the task's session
    undone = setup.carol.post(f"/tasks/{task['id']}/undo")
    assert undone.status_code == 200, undone.text
    assert "restored" in undone.json()["devices"]["alpha"] and not (setup.root / "report.txt").exists()
    [row] = [r for r in setup.audit(tool_name="undo_session") if task["id"] in r["arguments"]]
    assert row["status"] == "success" and row["approved_by"] == "api:carol"
    assert row["requested_by"] == f"undo:{task['id'][:12]} by api:carol"


def test_a_tasks_session_cannot_be_written_by_another_caller(setup: Setup) -> None:
    """The original chain: bob slips a change into alice's task session so that the task's (approved)
    undo would make it; the write is refused before it reaches the device, and audited."""
    (setup.temp / "config.ini").write_text("safe=1")
    task = alices_task(setup, "chain.txt")
    slipped = write(setup.temp / "config.ini", "safe=0", mode="overwrite")
    refused = setup.run(setup.bob, slipped, session_id=task["id"])
    assert refused.status_code == 403
    error = error_of(refused)
    assert f"session '{task['id']}' belongs to task {task['id']}" in error and "undo" in error
    assert (setup.temp / "config.ini").read_text() == "safe=1"
    [row] = setup.audit(call_id=slipped.call_id)
    assert row["requested_by"] == "api:bob" and row["status"] == "failure" and row["error"] == error
    assert row["tool_name"] == "write_file" and row["device"] == "alpha"
    # a person with the approve scope may not aim undo_session at the task's session either
    undo = Command(tool_name="undo_session", parameters={"session_id": task["id"]}, approved_by="me")
    refused = setup.run(setup.mallory, undo)
    assert refused.status_code == 403 and "undo_session refused" in error_of(refused)
    assert setup.audit(call_id=undo.call_id)[0]["status"] == "failure"
    assert (setup.root / "chain.txt").read_text() == "alice's work"
    # and the task's own undo puts back only what the task did
    undone = setup.carol.post(f"/tasks/{task['id']}/undo")
    assert undone.status_code == 200, undone.text
    assert not (setup.root / "chain.txt").exists() and (setup.temp / "config.ini").read_text() == "safe=1"


def test_a_session_belongs_to_the_token_that_named_it_first(setup: Setup) -> None:
    mine = write(setup.temp / "alice-notes.txt", "notes")
    done = setup.run(setup.alice, mine, session_id="alice-work")
    assert done.status_code == 200, done.text
    assert done.json()["results"][0]["status"] == "success"
    again = setup.run(setup.alice, write(setup.temp / "alice-more.txt", "more"), session_id="alice-work")
    assert again.status_code == 200 and again.json()["results"][0]["status"] == "success"
    theirs = write(setup.temp / "bob-was-here.txt", "x")
    refused = setup.run(setup.bob, theirs, session_id="alice-work")
    assert refused.status_code == 403
    assert error_of(refused) == ("refused: session 'alice-work' belongs to another API token; choose a session id "
                                 "of your own")
    assert not (setup.temp / "bob-was-here.txt").exists()
    assert setup.audit(call_id=theirs.call_id)[0]["error"].startswith("refused: session 'alice-work'")
    # a token's default session (what its batches without session_id run in) is reserved for it
    squat = write(setup.temp / "bob-squat.txt", "x")
    refused = setup.run(setup.bob, squat, session_id="api-alice")
    assert refused.status_code == 403 and "another API token's default session" in error_of(refused)
    assert "yours is 'api-bob'" in error_of(refused) and not (setup.temp / "bob-squat.txt").exists()
    assert setup.audit(call_id=squat.call_id)[0]["status"] == "failure"


def test_a_batch_without_a_session_runs_in_the_callers_own_not_the_devices_last(setup: Setup) -> None:
    """The device keeps the session of the batch it ran last; a REST batch that names none must not
    journal into it (it might be a task's): the server always sends the caller's own session."""
    task = alices_task(setup, "last-session.txt")  # the device's last session is now the task's
    (setup.temp / "shared.txt").write_text("v1")
    done = setup.run(setup.bob, write(setup.temp / "shared.txt", "v2", mode="overwrite"))
    assert done.status_code == 200 and done.json()["results"][0]["status"] == "success", done.text
    undone = setup.carol.post(f"/tasks/{task['id']}/undo")
    assert undone.status_code == 200, undone.text
    restored = undone.json()["devices"]["alpha"]["restored"]
    assert not any("shared.txt" in json.dumps(entry) for entry in restored), restored
    assert (setup.temp / "shared.txt").read_text() == "v2"  # bob's change is in api-bob, not in the task
    journal = setup.cluster.state / "dev-alpha" / "journal"
    assert (journal / "api-bob").is_dir()


# -- item 2: result replay through a caller-chosen call_id -----------------------------------------

def test_a_reused_call_id_never_returns_another_callers_result(setup: Setup) -> None:
    private = setup.root / "private.txt"
    private.write_text(PRIVATE)
    report = Command(tool_name="read_file", parameters={"file_path": str(private)}, call_id="nightly-report-1")
    first = setup.run(setup.alice, report)
    assert first.status_code == 200 and first.json()["results"][0]["result"]["content"] == PRIVATE
    # bob labels his own call the same: he gets the result of what he asked, run for him
    (setup.temp / "bob.txt").write_text("bob's own file")
    mine = Command(tool_name="read_file", parameters={"file_path": str(setup.temp / "bob.txt")},
                   call_id="nightly-report-1")
    second = setup.run(setup.bob, mine)
    assert second.status_code == 200, second.text
    [result] = second.json()["results"]
    assert result["status"] == "success" and result["call_id"] == "nightly-report-1"
    assert result["result"]["content"] == "bob's own file" and PRIVATE not in second.text
    # the very same command again runs again (the file changed since): a label is not a cache key
    private.write_text("updated")
    third = setup.run(setup.alice, report)
    assert third.json()["results"][0]["result"]["content"] == "updated"
    rows = setup.audit(call_id="nightly-report-1")
    assert sorted(r["requested_by"] for r in rows) == ["api:alice", "api:alice", "api:bob"]
    assert len({r["response_id"] for r in rows}) == 3  # three batches, each its own identity


def test_a_delete_reusing_a_call_id_really_runs_and_the_audit_says_what_happened(setup: Setup) -> None:
    (setup.temp / "keep.txt").write_text("k")
    (setup.temp / "scratch.txt").write_text("s")
    first = setup.run(setup.alice, Command(tool_name="read_file", call_id="cleanup-7",
                                           parameters={"file_path": str(setup.temp / "keep.txt")}))
    assert first.json()["results"][0]["status"] == "success"
    delete = Command(tool_name="delete_file", parameters={"path": str(setup.temp / "scratch.txt")},
                     call_id="cleanup-7")
    done = setup.run(setup.bob, delete)
    assert done.status_code == 200, done.text
    [result] = done.json()["results"]
    assert result["status"] == "success" and "content" not in (result.get("result") or {}), result
    assert not (setup.temp / "scratch.txt").exists()  # it ran: the success is true
    [row] = [r for r in setup.audit(call_id="cleanup-7") if r["tool_name"] == "delete_file"]
    assert row["requested_by"] == "api:bob" and row["status"] == "success"
    # deleting a file that is gone fails for real instead of replaying the earlier success
    again = setup.run(setup.bob, delete.model_copy())
    assert again.json()["results"][0]["status"] == "failure"
    assert [r["status"] for r in setup.audit(call_id="cleanup-7", tool_name="delete_file")] == ["failure", "success"]
