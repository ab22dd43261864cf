"""Every HTTP route that decides something, tried with every credential an agent could hold (red team of "people
approve; devices prove who they are", docs/security/approvals-red-team.md).

The routes are taken from the server's own OpenAPI document, so a new route that changes state fails this test
until it is classed here as deciding (tried below) or as an agent's to use (listed with why). The credentials:
an agent's token, an agent's token scoped to the device, a person's read-only token, the device's own token,
and none. Each deciding route is sent the body that would approve, with a real task waiting on a real
approval (the device holds `rm` of a file outside its temp directory for a person), so the refusal is the
route's check, not a missing thing. Afterwards nothing was approved, deleted, made or changed.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits.server_target import error_of
from tests.kits.task import WAIT, AgentServer
from tether.tools.policy.model import default_policy

# (method, OpenAPI path) → why an agent's token may use it: none of these approves, answers a person's
# question, changes a policy, makes or revokes a credential, or lets a device in
AN_AGENTS: dict[tuple[str, str], str] = {
    ("POST", "/api/v1/devices/{name}/commands"): "runs a command (one sent approved is tried below)",
    ("POST", "/api/v1/commands"): "runs a command on a chosen device (approved: tried below)",
    ("POST", "/api/v1/fleet/commands"): "runs a command on many devices (approved: tried below)",
    ("DELETE", "/api/v1/batches/{response_id}"): "cancels a batch: stopping is never approving",
    ("DELETE", "/api/v1/fleet/commands/{fanout_id}"): "cancels a fan-out",
    ("POST", "/api/v1/webhooks"): "the token's own webhook (a server-wide one needs a fleet admin)",
    ("DELETE", "/api/v1/webhooks/{webhook_id}"): "the token's own webhook",
    ("POST", "/api/v1/webhooks/{webhook_id}/test"): "the token's own webhook",
    ("POST", "/api/v1/transfers"): "copies files (one sent approved is tried below)",
    ("POST", "/api/v1/pairing"): "a device asks to be let in (it proves its key at claim; an admin decides)",
    ("POST", "/api/v1/pairing/{code}/claim"): "a device takes its token once an admin approved, signed by its key",
    ("POST", "/api/v1/tasks"): "creates a task that acts for this token",
    ("POST", "/api/v1/tasks/dry-run"): "plans without running",
    ("POST", "/api/v1/tasks/{task_id}/cancel"): "stopping is never approving",
    ("POST", "/api/v1/tasks/{task_id}/edits"): "adds steps, which wait for a person when the confirm mode says so",
}


def _approving(task: str, victim: Path, root: Path) -> list[tuple[str, str, str, dict[str, Any] | None]]:
    """(method, OpenAPI path, URL, body): each deciding route with the body that would approve or change."""
    rm = {"tool_name": "shell.run", "approved_by": "cli:alice",
          "parameters": {"cmd": "rm", "argv": [str(victim)], "cwd": str(root)}}
    return [
        ("POST", "/api/v1/tasks/{task_id}/approval", f"/tasks/{task}/approval", {"approved": True}),
        ("POST", "/api/v1/tasks/{task_id}/answer", f"/tasks/{task}/answer", {"answer": "approve"}),
        ("POST", "/api/v1/tasks/{task_id}/undo", f"/tasks/{task}/undo", None),
        ("POST", "/api/v1/devices/{name}/questions/{question}", "/devices/alpha/questions/q-1", {"action": "accept"}),
        ("POST", "/api/v1/devices/{name}/commands", "/devices/alpha/commands", {"commands": [rm]}),
        ("POST", "/api/v1/commands", "/commands", {"commands": [rm]}),
        ("POST", "/api/v1/fleet/commands", "/fleet/commands", {"commands": [rm]}),
        ("POST", "/api/v1/transfers", "/transfers", {"source": "alpha", "source_path": str(victim), "dest": "alpha",
                                                     "dest_path": str(root / "copy"), "approve": True}),
        ("PUT", "/api/v1/devices/{name}/policy", "/devices/alpha/policy", {"policy": {"write_roots": ["/"]}}),
        ("POST", "/api/v1/devices/{name}/policy/{verb}", "/devices/alpha/policy/allow", {"commands": ["rm"]}),
        ("POST", "/api/v1/tokens", "/tokens", {"kind": "api", "name": "minted", "scopes": ["approve"]}),
        ("DELETE", "/api/v1/tokens/{token}", "/tokens/root", None),
        ("DELETE", "/api/v1/devices/{name}", "/devices/alpha", None),
        ("PATCH", "/api/v1/devices/{name}", "/devices/alpha", {"name": "stolen"}),
        ("POST", "/api/v1/pairing/{code}/approve", "/pairing/ABCD-EFGH/approve", {"name": "alpha", "replace": True}),
        ("POST", "/api/v1/pairing/{code}/refuse", "/pairing/ABCD-EFGH/refuse", None),
    ]


@pytest.fixture
async def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[AgentServer, Path]]:
    other_temp = tmp_path / "device-temp"  # deleting in the device's temp dir needs no approval: not there
    other_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(other_temp))
    root = tmp_path / "alpha"
    root.mkdir()
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    async with AgentServer(tmp_path) as agent_server:
        await agent_server.add_device("alpha", policy, tmp_path / "state-alpha")
        yield agent_server, root


async def test_no_credential_an_agent_holds_decides_anything(server: tuple[AgentServer, Path]) -> None:
    agent_server, root = server
    tokens = agent_server.store.tokens
    base = f"http://127.0.0.1:{agent_server.port}"
    async with httpx.AsyncClient(base_url=base, timeout=WAIT) as http:
        spec = (await http.get("/openapi.json")).json()
    changing = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops
                if method.upper() in ("POST", "PUT", "PATCH", "DELETE")}
    victim = root / "keep.txt"
    victim.write_text("precious\n")
    tried = _approving("TASK", victim, root)
    unclassed = changing - set(AN_AGENTS) - {(m, p) for m, p, _, _ in tried}
    assert not unclassed, f"class these routes as deciding (tried here) or an agent's to use: {sorted(unclassed)}"

    person = tokens.create("api", "alice", ["read", "execute", "approve"])[1]
    created = await agent_server.api.post("/tasks", headers={"Authorization": f"Bearer {person}"},
                                          json={"device": "alpha", "plan": [{"skill": "shell.run", "args": {
                                              "cmd": "rm", "argv": [str(victim)], "cwd": str(root)}}]})
    assert created.status_code == 201, created.text
    task = created.json()["id"]
    seen = await agent_server.events_until(task, lambda e: e["kind"] == "question")
    assert seen[-1]["data"]["kind"] == "approval", seen[-1]
    credentials = {
        "an agent's token": tokens.create("api", "robot", ["read", "execute"], agent=True)[1],
        "an agent's token scoped to alpha": tokens.create("api", "robot-alpha", ["read", "execute"], agent=True,
                                                          devices=["alpha"])[1],
        "a person's read-only token": tokens.create("api", "reader", ["read"])[1],
        "the device's own token": tokens.create("device", "alpha-2")[1],
        "no token": "",
    }
    before = {t.name for t in tokens.all()}
    async with httpx.AsyncClient(base_url=f"{base}/api/v1", timeout=WAIT) as http:
        policy_before = (await agent_server.api.get("/devices/alpha/policy")).json()
        for who, secret in credentials.items():
            headers = {"Authorization": f"Bearer {secret}"} if secret else {}
            for method, _, url, body in _approving(task, victim, root):
                answer = await http.request(method, url, json=body, headers=headers)
                assert answer.status_code in (401, 403), (who, method, url, answer.status_code, answer.text)
                assert error_of(answer.content), (who, method, url, answer.text)
    assert victim.read_text() == "precious\n"
    assert {t.name for t in tokens.all()} == before
    waiting = (await agent_server.api.get(f"/tasks/{task}")).json()
    assert waiting["state"] == "waiting_for_user" and waiting["questions"][-1]["answer"] is None, waiting["state"]
    assert (await agent_server.api.get("/devices/alpha/policy")).json() == policy_before
    assert (await agent_server.api.get("/devices/alpha")).status_code == 200
