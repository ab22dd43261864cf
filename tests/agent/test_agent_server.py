"""Tasks on the agent server: the task API, real devices over AIP, a scripted LLM, restarts, undo."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from bench.kit.fake_llm import FakeLLM
from tests.kits.task import AgentServer
from tether.agent.tasks.service import TaskError
from tether.tools.policy.model import Policy, default_policy


@pytest.fixture
def jailed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A policy per device that may write only in its own folder (so where a step ran is visible)."""
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))

    def make(name: str) -> tuple[Policy, Path]:
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        return default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]}), root

    return make


def write(path: Path, content: str, device: str | None = None) -> dict[str, Any]:
    step: dict[str, Any] = {"skill": "write_file", "args": {"file_path": str(path), "content": content},
                            "description": f"write {path.name}"}
    if device:
        step["device"] = device
    return step


def shell(cmd: str, argv: list[str], cwd: Path, **extra: Any) -> dict[str, Any]:
    return {"skill": "shell.run", "args": {"cmd": cmd, "argv": argv, "cwd": str(cwd), **extra}}


def reply(obj: Any) -> str:
    return json.dumps(obj)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


async def test_plan_runs_on_the_device_with_streamed_events_and_audit(tmp_path: Path, jailed: Any) -> None:
    policy, root = jailed("alpha")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="make a demo folder", device="alpha",
                                      plan=[shell("mkdir", [str(root / "demo")], root),
                                            write(root / "demo" / "hello-world.txt", "hello"),
                                            shell("echo", ["hi there"], root)])
        assert created["state"] in ("created", "running") and created["device"] == "alpha"
        events = await server.events_until(created["id"], lambda e: False)
        task = (await server.api.get(f"/tasks/{created['id']}")).json()
        listed = (await server.api.get("/tasks")).json()
        audit = server.store.audit.rows(limit=10)
    assert task["state"] == "done", task["error"]
    assert (root / "demo" / "hello-world.txt").read_text() == "hello"
    assert [e["seq"] for e in events[:-1]] == list(range(len(events) - 1))  # every event, in order, once
    assert events[-1]["kind"] == "end" and events[-1]["data"]["state"] == "done"
    assert any(e["kind"] == "output" and "hi there" in e["data"].get("data", "") for e in events)
    assert [s["result"]["status"] for s in task["steps"]] == ["success"] * 3
    assert listed[0]["id"] == task["id"] and listed[0]["device"] == "alpha" and listed[0]["state"] == "done"
    ran = [r for r in audit if r["tool_name"] in ("shell.run", "write_file")]
    assert len(ran) == 3 and all(r["requested_by"] == f"task:{task['id'][:12]} for api:tester-0" for r in ran)


async def test_llm_plan_ask_user_answered_through_the_api(tmp_path: Path, jailed: Any) -> None:
    policy, root = jailed("alpha")
    (root / "b.txt").write_text("bee")
    first = {"steps": [{"skill": "read_file", "args": {"file_path": str(root / "which.txt")}}]}
    question = {"decision": "ASK_USER", "question": "Which file did you mean?", "options": ["a.txt", "b.txt"]}
    second = {"steps": [{"skill": "read_file", "args": {"file_path": str(root / "b.txt")}}]}
    async with FakeLLM([reply(first), reply(question), reply(second), "It says bee."]) as fake, \
            AgentServer(tmp_path, llm=fake.settings()) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="read the file", device="alpha")
        events = await server.events_until(created["id"], lambda e: e["kind"] == "question")
        asked = events[-1]["data"]
        assert asked["question"] == "Which file did you mean?"
        waiting = (await server.api.get(f"/tasks/{created['id']}")).json()
        assert waiting["state"] == "waiting_for_user"
        wrong = await server.api.post(f"/tasks/{created['id']}/answer", json={"answer": "b.txt", "question_id": "x"})
        assert wrong.status_code == 409 and "not the open one" in wrong.json()["error"]
        answered = await server.api.post(f"/tasks/{created['id']}/answer",
                                         json={"answer": "2", "question_id": asked["id"]})
        assert answered.status_code == 200, answered.text
        task = await server.finished(created["id"])
        again = await server.api.post(f"/tasks/{created['id']}/answer", json={"answer": "b.txt"})
    assert task["id"] == created["id"] and task["state"] == "done", task["error"]
    assert task["questions"][0]["answer"] == "2" and task["answer"] == "It says bee."
    assert task["steps"][-1]["result"]["result"]["content"] == "bee"
    assert "b.txt" in fake.requests[2]["messages"][-1]["content"]  # the answer became the replan's constraint
    planning = json.dumps(fake.requests[0]["messages"])
    assert "alpha" in planning and "no profile" not in planning and "read_file" in planning  # profile and tools
    assert f"may write under {root}" in planning and "home " in planning  # real paths the plan may use
    assert again.status_code == 409 and "no open question" in again.json()["error"]


@pytest.mark.parametrize("approved", [False, True])
async def test_approval_through_the_api(tmp_path: Path, jailed: Any, approved: bool) -> None:
    policy, root = jailed("alpha")
    victim = root / "old"
    victim.mkdir()
    (victim / "f.txt").write_text("x")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="remove old", device="alpha",
                                      plan=[shell("rm", ["-r", str(victim)], root)])
        events = await server.events_until(created["id"], lambda e: e["kind"] == "question")
        assert events[-1]["data"]["kind"] == "approval"
        wrong = await server.api.post(f"/tasks/{created['id']}/approval", json={"approved": "maybe"})
        assert wrong.status_code == 422
        response = await server.api.post(f"/tasks/{created['id']}/approval", json={"approved": approved})
        assert response.status_code == 200, response.text
        assert response.json()["state"] == ("running" if approved else "cancelled")  # current, not stale
        task = await server.finished(created["id"])
        audit = [r for r in server.store.audit.rows(limit=10) if r["tool_name"] == "shell.run"]
    assert [r["approved_by"] for r in reversed(audit)] == ([None, "api:tester-0"] if approved else [None])
    assert task["questions"][0]["answered_by"] == "api:tester-0"
    if approved:
        assert task["state"] == "done" and not victim.exists()
        assert [s["command"]["approved_by"] for s in task["steps"]] == [None, "api:tester-0"]
    else:
        assert task["state"] == "cancelled" and "not approved" in task["error"] and victim.exists()


async def test_two_device_plan_runs_each_step_on_its_device_and_undo_reaches_both(tmp_path: Path,
                                                                                  jailed: Any) -> None:
    policy_a, root_a = jailed("alpha")
    policy_b, root_b = jailed("beta")
    (root_b / "keep.txt").write_text("original")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy_a, tmp_path / "state-alpha")
        await server.add_device("beta", policy_b, tmp_path / "state-beta")
        overwrite = write(root_b / "keep.txt", "changed on beta", device="beta")
        overwrite["args"]["mode"] = "overwrite"  # changing an existing file needs an approval
        created = await server.create(request="one file on each", device="alpha",
                                      plan=[write(root_a / "a.txt", "on alpha"), overwrite,
                                            write(root_a / "a2.txt", "alpha again", device="alpha")])
        asked = await server.events_until(created["id"], lambda e: e["kind"] == "question")
        assert asked[-1]["data"]["kind"] == "approval" and "keep.txt" in asked[-1]["data"]["question"]
        approved = await server.api.post(f"/tasks/{created['id']}/approval", json={"approved": True})
        assert approved.status_code == 200, approved.text
        task = await server.finished(created["id"])
        audit = server.store.audit.rows(limit=20)
        assert (root_b / "keep.txt").read_text() == "changed on beta"
        undone = await server.api.post(f"/tasks/{created['id']}/undo")
    assert task["state"] == "done", task["error"]
    # each device's policy only lets it write its own folder: a step on the wrong device would fail
    writes = [(r["device"], r["arguments"]) for r in reversed(audit) if r["tool_name"] == "write_file"]
    assert [d for d, _ in writes] == ["alpha", "beta", "beta", "alpha"]  # beta's second try was approved
    assert undone.status_code == 200, undone.text
    report = undone.json()["devices"]
    assert set(report) == {"alpha", "beta"} and all("restored" in v for v in report.values()), report
    assert not (root_a / "a.txt").exists() and not (root_a / "a2.txt").exists()
    assert (root_b / "keep.txt").read_text() == "original"


async def test_a_step_waits_for_its_device_to_come_back(tmp_path: Path, jailed: Any) -> None:
    policy_a, root_a = jailed("alpha")
    policy_b, root_b = jailed("beta")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy_a, tmp_path / "state-alpha")
        await server.add_device("beta", policy_b, tmp_path / "state-beta")
        await server.drop_device("beta")
        created = await server.create(request="one on each", device="alpha",
                                      plan=[write(root_a / "a.txt", "a"), write(root_b / "b.txt", "b", device="beta")])
        waited = await server.events_until(created["id"], lambda e: e["kind"] == "waiting_for_device")
        assert waited[-1]["data"]["device"] == "beta"
        await server.add_device("beta", policy_b, tmp_path / "state-beta")
        task = await server.finished(created["id"])
    assert task["state"] == "done", task["error"]
    assert (root_b / "b.txt").read_text() == "b" and len(task["steps"]) == 2


async def test_cancel_stops_the_running_command(tmp_path: Path, jailed: Any) -> None:
    policy, root = jailed("alpha")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="wait", device="alpha",
                                      plan=[shell("sleep", ["60"], root), write(root / "never.txt", "x")])
        await server.events_until(created["id"], lambda e: e["kind"] == "step_started")
        response = await server.api.post(f"/tasks/{created['id']}/cancel")
        assert response.status_code == 200, response.text
        task = await server.finished(created["id"])
        again = await server.api.post(f"/tasks/{created['id']}/cancel")
    assert task["state"] == "cancelled" and not (root / "never.txt").exists()
    assert again.status_code == 409 and "already ended" in again.json()["error"]


async def test_bad_requests_get_clear_errors(tmp_path: Path, jailed: Any) -> None:
    policy, root = jailed("alpha")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        api = server.api
        no_llm = await api.post("/tasks", json={"request": "do something", "device": "alpha"})
        assert no_llm.status_code == 409 and "no LLM" in no_llm.json()["error"]
        unknown = await api.post("/tasks", json={"plan": [write(root / "x", "x")], "device": "nope"})
        assert unknown.status_code == 404 and "no device named 'nope'" in unknown.json()["error"]
        other = await api.post("/tasks", json={"plan": [write(root / "x", "x", device="ghost")], "device": "alpha"})
        assert other.status_code == 404 and "ghost" in other.json()["error"]
        nothing = await api.post("/tasks", json={"device": "alpha"})
        assert nothing.status_code == 422
        extra = await api.post("/tasks", json={"plan": [], "device": "alpha", "colour": "red"})
        assert extra.status_code == 422 and "colour" in extra.json()["error"]
        gpu = await api.post("/tasks", json={"plan": [write(root / "x", "x")], "requires": {"gpu": True}})
        assert gpu.status_code == 409
        assert (await api.get("/tasks/0000")).status_code == 404
        with pytest.raises(TaskError) as ambiguous:  # two tasks exist now: an empty prefix names neither
            server.tasks.get("")
        assert ambiguous.value.status == 404
        assert (await api.get("/tasks/0000/events")).status_code == 404
        assert (await api.post("/tasks/0000/answer", json={"answer": "x"})).status_code == 404
        noauth = await api.get("/tasks", headers={"Authorization": "Bearer wrong"})
        assert noauth.status_code == 401
        # a plan with an unknown skill and bad arguments fails clearly, before anything runs
        created = await server.create(device="alpha", plan=[{"skill": "teleport", "args": {}},
                                                            {"skill": "write_file", "args": {"content": 3}}])
        task = await server.finished(created["id"])
        assert task["state"] == "failed" and "unknown skill 'teleport'" in task["error"]
        assert "file_path" in task["error"] and not task["steps"]


async def test_restart_keeps_tasks_and_resumes_them(tmp_path: Path, jailed: Any) -> None:
    policy, root = jailed("alpha")
    db = tmp_path / "server.db"
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        (root / "old").mkdir()
        (root / "old" / "f.txt").write_text("x")
        asking = await server.create(request="remove old", device="alpha",
                                     plan=[shell("rm", ["-r", str(root / "old")], root), write(root / "after", "1")])
        asked = await server.events_until(asking["id"], lambda e: e["kind"] == "question")
        assert asked[-1]["data"]["kind"] == "approval"
        running = await server.create(request="slow", device="alpha",
                                      plan=[shell("sleep", ["60"], root), write(root / "then.txt", "2")])
        await server.events_until(running["id"], lambda e: e["kind"] == "step_started")
    # the server stopped with one task waiting for approval and one in the middle of a command
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha-2")
        # the step in flight is first asked about on the device (a new process: no record of it), then the person
        await server.events_until(running["id"], lambda e: e["kind"] == "question" and e["data"]["kind"] == "restart")
        listed = {t["id"]: t for t in (await server.api.get("/tasks")).json()}
        assert listed[asking["id"]]["state"] == "waiting_for_user"
        assert listed[running["id"]]["state"] == "waiting_for_user"
        slow = (await server.api.get(f"/tasks/{running['id']}")).json()
        assert slow["questions"][-1]["kind"] == "restart" and "sleep" in slow["questions"][-1]["question"]
        assert slow["questions"][-1]["options"] == ["retry", "skip this step", "cancel"]
        assert "server_restarted" in kinds(slow["events"])
        # answers resume the same tasks where they stopped
        assert (await server.api.post(f"/tasks/{asking['id']}/approval", json={"approved": True})).status_code == 200
        assert (await server.api.post(f"/tasks/{running['id']}/answer", json={"answer": "skip"})).status_code == 200
        first = await server.finished(asking["id"])
        second = await server.finished(running["id"])
    assert first["state"] == "done", first["error"]
    assert kinds(first["events"]).count("question") == 1  # resumed with its answer, not asked again
    assert not (root / "old").exists() and (root / "after").read_text() == "1"
    assert second["state"] == "done", second["error"]
    assert (root / "then.txt").read_text() == "2"
    assert [s["step"]["skill"] for s in second["steps"]] == ["write_file"]  # the sleep was skipped, not re-run


async def test_invalid_plan_then_valid_one_and_events_resume_after_a_seq(tmp_path: Path, jailed: Any) -> None:
    policy, root = jailed("alpha")
    invalid = {"steps": [{"skill": "teleport", "args": {}}]}
    valid = {"steps": [write(root / "out.txt", "made")]}
    async with FakeLLM([reply(invalid), reply(valid), "Wrote out.txt."]) as fake, \
            AgentServer(tmp_path, llm=fake.settings()) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="write out.txt", device="alpha")
        task = await server.finished(created["id"])
        later = await server.events_until(created["id"], lambda e: False, after=task["events"][-3]["seq"])
        done = (await server.api.get("/tasks", params={"state": "done"})).json()
        failed = (await server.api.get("/tasks", params={"state": "failed"})).json()
    assert task["state"] == "done", task["error"]
    assert (root / "out.txt").read_text() == "made"
    assert "teleport" in fake.requests[1]["messages"][-1]["content"]  # the re-ask names what was wrong
    assert task["counters"]["llm_calls"] == 3
    assert [e["seq"] for e in later[:-1]] == [e["seq"] for e in task["events"][-2:]] and later[-1]["kind"] == "end"
    assert [t["id"] for t in done] == [task["id"]] and failed == []


async def test_approvals_need_the_approve_scope(tmp_path: Path, jailed: Any) -> None:
    policy, root = jailed("alpha")
    victim = root / "old"
    victim.mkdir()
    (victim / "f.txt").write_text("x")
    rm = shell("rm", ["-r", str(victim)], root)
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        agent = {"Authorization": f"Bearer {server.agent_token}"}
        created = (await server.api.post("/tasks", json={"device": "alpha", "plan": [rm]}, headers=agent)).json()
        await server.events_until(created["id"], lambda e: e["kind"] == "question")
        for path, body in (("approval", {"approved": True}), ("answer", {"answer": "approve"})):
            refused = await server.api.post(f"/tasks/{created['id']}/{path}", json=body, headers=agent)
            assert refused.status_code == 403 and "'approve' scope" in refused.json()["error"]
        # nor can it send the command as approved straight to the device
        command = {"tool_name": "shell.run", "parameters": rm["args"], "approved_by": "user"}
        direct = await server.api.post("/devices/alpha/commands", json={"commands": [command]}, headers=agent)
        assert direct.status_code == 403 and victim.exists()
        # a person's token may; the audit log names the token, not what the caller wrote
        ran = await server.api.post("/devices/alpha/commands", json={"commands": [command]})
        assert ran.status_code == 200 and ran.json()["results"][0]["status"] == "success", ran.text
        assert not victim.exists()
        server.store.audit.flush()
        [row] = [r for r in server.store.audit.rows(limit=50) if r["tool_name"] == "shell.run" and r["approved_by"]]
        assert row["requested_by"] == "api:tester-0" and row["approved_by"] == "api:tester-0"
        assert (await server.api.post(f"/tasks/{created['id']}/cancel", headers=agent)).status_code == 200


async def test_llm_plans_across_two_devices_when_asked_to(tmp_path: Path, jailed: Any) -> None:
    policy_a, root_a = jailed("alpha")
    policy_b, root_b = jailed("beta")
    plan = {"steps": [write(root_a / "from-alpha.txt", "a", device="alpha"),
                      write(root_b / "from-beta.txt", "b", device="beta")]}
    async with FakeLLM([reply(plan), "Both written."]) as fake, AgentServer(tmp_path, llm=fake.settings()) as server:
        await server.add_device("alpha", policy_a, tmp_path / "state-alpha")
        await server.add_device("beta", policy_b, tmp_path / "state-beta")
        created = await server.create(request="a file on each machine", device="alpha", devices=["beta"])
        task = await server.finished(created["id"])
    assert task["state"] == "done", task["error"]
    assert (root_a / "from-alpha.txt").read_text() == "a" and (root_b / "from-beta.txt").read_text() == "b"
    prompt = json.dumps(fake.requests[0]["messages"])
    assert f"may write under {root_a}" in prompt and f"may write under {root_b}" in prompt  # both profiles
    assert task["devices"] == ["beta"]


async def test_a_follower_too_far_behind_is_ended_not_fed_a_gap(tmp_path: Path, jailed: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import tether.agent.tasks.service.followers as service_module

    monkeypatch.setattr(service_module, "_SUBSCRIBER_QUEUE", 4)
    policy, root = jailed("alpha")
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(device="alpha", plan=[write(root / f"{n}.txt", "x") for n in range(3)]
                                      + [shell("sleep", ["60"], root)])
        _, _, queue = server.tasks.subscribe(created["id"], after=10**9)  # a follower that never reads
        assert queue is not None
        await server.events_until(created["id"], lambda e: e["kind"] == "step_started" and e["data"]["step"] == 3)
        got = [queue.get_nowait() for _ in range(queue.qsize())]  # while the task still runs
        assert (await server.api.post(f"/tasks/{created['id']}/cancel")).status_code == 200
    assert got[-1] is None and all(e is not None for e in got[:-1]) and len(got) <= 4
    seqs = [e.seq for e in got[:-1]]
    assert seqs == sorted(seqs)  # what it got has no hole; it resumes from the last one with ?after=
