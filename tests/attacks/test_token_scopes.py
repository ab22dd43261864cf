"""Attacks on token scopes (issue 27, item 3): a token scoped to `dev1` reaching `dev2`, at every surface.

The token `tether mcp config --device dev1` made reached every device: `--device` only filtered what
tools/list showed. Here the whole agent server runs (REST, AIP, tasks, `/mcp`) with two real devices
connected over AIP (built-in tools, a real policy); `dev2` also runs a real stdio MCP server
(tests/servers/interactive.py) whose questions go through the server. A token scoped to `dev1` tries
`dev2` through each surface — REST exec, the least-loaded choice, fan-out, device list and detail, the
dashboard's event stream, the audit, the policy, tasks (choosing, naming, fanning out, reading another's),
the MCP gateway's tools/list and tools/call, and answering `dev2`'s question — and is refused each time
with `{"error": …}` naming the scope, while `dev1` works through the same surface.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import mcp_types as types
import pytest

from tests.kits.gateway import mcp_client
from tests.kits.netutil import CLI
from tests.kits.sse import async_sse_events
from tests.kits.task import WAIT, AgentServer
from tether.device.config import load_device_config
from tether.device.link.connection import DeviceConnection, LinkHooks
from tether.device.local import build_device
from tether.device.mcp.client.client_caps import MCPClientHooks
from tether.device.mcp.client.elicit import RemoteQuestions
from tether.device.policy_overlay import RemotePolicy
from tether.device.probe import collect_profile
from tether.protocol.models import Command
from tether.tools.policy.model import default_policy

INTERACTIVE = str(Path(__file__).parent.parent / "servers" / "interactive.py")
LIST_TOOLS = {"tool_name": "list_tools", "tool_type": "data_collection"}
ALL = ["read", "execute", "approve", "admin"]


class Fleet:
    """The agent server, its two devices, an unscoped admin and the attacker's token scoped to dev1."""

    def __init__(self, agent: AgentServer) -> None:
        self.agent = agent
        store = agent.store
        self.admin = store.tokens.create("api", "root", ALL)[1]
        self.scoped = store.tokens.create("api", "attacker", ALL, devices=["dev1"])[1]
        self.base = f"http://127.0.0.1:{agent.port}"

    def http(self, token: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=f"{self.base}/api/v1", headers={"Authorization": f"Bearer {token}"},
                                 timeout=WAIT)


async def add_device(agent: AgentServer, name: str, state: Path, tag: str, config: Path | None = None) -> None:
    """A real device as `tether device` builds it: built-in tools, a policy, its tag, and (with `config`)
    external MCP servers whose questions go out as events of the command and come back over AIP."""
    policy = default_policy().model_copy(update={"read_roots": [str(state)], "write_roots": [str(state)],
                                                 "policy_remote": True})
    questions = RemoteQuestions()
    device = build_device(load_device_config(config) if config else None, policy=policy, state_dir=state,
                          client_id=name, mcp_hooks=MCPClientHooks(elicit=questions.elicit))
    secret = agent.store.tokens.create("device", name)[1]
    link = DeviceConnection(device.client, f"ws://127.0.0.1:{agent.port}/aip", secret, name=name,
                            profile=lambda: collect_profile(device, tags=[tag]),
                            hooks=LinkHooks(policy=RemotePolicy(device.policy, state), questions=questions))
    job = asyncio.create_task(link.run())
    agent.devices.append((device, link, job))
    await asyncio.wait_for(link.connected.wait(), WAIT)


async def start(tmp_path: Path, dev2_config: Path | None = None) -> AsyncIterator[Fleet]:
    async with AgentServer(tmp_path) as agent:
        for name, tag, extra in (("dev1", "blue", None), ("dev2", "red", dev2_config)):
            (tmp_path / name).mkdir()
            await add_device(agent, name, tmp_path / name, tag, extra)
        yield Fleet(agent)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async for running in start(tmp_path):
        yield running


@pytest.fixture
async def asking_fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    """The fleet with a real stdio MCP server on dev2 that asks questions (tests/servers/interactive.py)."""
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"interactive": {"command": sys.executable, "args": [INTERACTIVE]}}}))
    async for running in start(tmp_path, config):
        yield running


def refused(response: httpx.Response, status: int = 404) -> str:
    """The error of a refusal, which must name the token's scope."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert "scope" in body["error"] and "dev1" in body["error"], body["error"]
    return body["error"]


async def test_rest_exec_batch_and_fan_out_stay_on_dev1(fleet: Fleet) -> None:
    async with fleet.http(fleet.scoped) as http:
        # one device, named
        error = refused(await http.post("/devices/dev2/commands", json={"commands": [LIST_TOOLS]}))
        assert "dev2" in error
        # the same words as for a device that never registered: the refusal does not say dev2 exists
        assert refused(await http.post("/devices/nothing/commands", json={"commands": [LIST_TOOLS]})) \
            == error.replace("dev2", "nothing")
        mine = await http.post("/devices/dev1/commands", json={"commands": [LIST_TOOLS]})
        assert mine.status_code == 200 and mine.json()["results"][0]["status"] == "success", mine.text
        # the least-loaded choice: dev2 is not among the candidates
        refused(await http.post("/commands", json={"commands": [LIST_TOOLS], "requires": {"name": "dev2"}}), 409)
        chosen = await http.post("/commands", json={"commands": [LIST_TOOLS], "requires": {"tags": []}})
        assert chosen.status_code == 200 and chosen.json()["device"] == "dev1", chosen.text
        # fan-out to every device (--all) and by dev2's tag
        everyone = await http.post("/fleet/commands", json={"commands": [LIST_TOOLS]})
        assert everyone.status_code == 200, everyone.text
        assert [d["device"] for d in everyone.json()["devices"]] == ["dev1"]
        assert everyone.json()["summary"]["total"] == 1
        refused(await http.post("/fleet/commands", json={"commands": [LIST_TOOLS], "requires": {"tags": ["red"]}}))
    async with fleet.http(fleet.admin) as admin:  # unscoped: every device, as before scopes
        both = await admin.post("/fleet/commands", json={"commands": [LIST_TOOLS]})
        assert sorted(d["device"] for d in both.json()["devices"]) == ["dev1", "dev2"]


async def test_device_list_detail_tools_policy_and_tokens(fleet: Fleet) -> None:
    async with fleet.http(fleet.scoped) as http:
        listed = await http.get("/devices")
        assert [d["name"] for d in listed.json()] == ["dev1"], listed.text
        assert [d["name"] for d in (await http.get("/devices", params={"tag": "red"})).json()] == []
        refused(await http.get("/devices/dev2"))
        assert (await http.get("/devices/dev1")).status_code == 200
        refused(await http.get("/devices/dev2/tools"))
        refused(await http.get("/devices/dev2/policy"))
        refused(await http.put("/devices/dev2/policy", json={"policy": {"commands": {"rm": {}}}}))
        refused(await http.post("/devices/dev2/policy/allow", json={"program": "rm"}))
        mine = await http.get("/devices/dev1/policy")
        assert mine.status_code == 200, mine.text
        changed = await http.post("/devices/dev1/policy/allow", json={"program": "true"})
        assert changed.status_code == 200 and "true" in changed.json()["policy"]["commands"], changed.text
        # its admin scope does not reach the fleet's keys: it could make itself an unscoped token
        made = await http.post("/tokens", json={"kind": "api", "name": "wider", "scopes": ["admin"]})
        refused(made, 403)
        refused(await http.get("/tokens"), 403)
        refused(await http.delete("/tokens/root"), 403)
        refused(await http.get("/pairing"), 403)  # nor approve a new device into the fleet
    async with fleet.http(fleet.admin) as admin:
        assert sorted(d["name"] for d in (await admin.get("/devices")).json()) == ["dev1", "dev2"]


async def test_tag_scope_reaches_the_devices_with_the_tag(fleet: Fleet) -> None:
    blue = fleet.agent.store.tokens.create("api", "blue-only", ["read", "execute"], tags=["blue"])[1]
    async with fleet.http(blue) as http:
        assert [d["name"] for d in (await http.get("/devices")).json()] == ["dev1"]
        error = (await http.post("/devices/dev2/commands", json={"commands": [LIST_TOOLS]})).json()["error"]
        assert "tags blue" in error
        ran = await http.post("/devices/dev1/commands", json={"commands": [LIST_TOOLS]})
        assert ran.status_code == 200, ran.text


async def test_events_and_audit_show_only_dev1(fleet: Fleet) -> None:
    async with fleet.http(fleet.admin) as admin:
        ran = await admin.post("/devices/dev2/commands", json={"commands": [LIST_TOOLS]})
        assert ran.status_code == 200, ran.text
        ran = await admin.post("/devices/dev1/commands", json={"commands": [LIST_TOOLS]})
        assert ran.status_code == 200, ran.text
        assert {r["device"] for r in (await admin.get("/audit")).json()["rows"]} >= {"dev1", "dev2"}
    async with fleet.http(fleet.scoped) as http:
        rows = (await http.get("/audit")).json()["rows"]
        assert rows and {r["device"] for r in rows} == {"dev1"}
        refused(await http.get("/audit", params={"device": "dev2"}))
        # the dashboard's fleet stream: its first event lists every device the token sees
        async with http.stream("GET", f"{fleet.base}/web/fleet") as stream:
            assert stream.status_code == 200
            async for _, rows in async_sse_events(stream.aiter_lines()):
                assert [d["name"] for d in rows] == ["dev1"]
                break
        # a device page's stream (one device's row): another device's is not there when asked by name
        for name, seen in (("dev2", []), ("dev1", ["dev1"]), ("no-such", [])):
            async with http.stream("GET", f"{fleet.base}/web/fleet", params={"device": name}) as stream:
                assert stream.status_code == 200
                async for _, rows in async_sse_events(stream.aiter_lines()):
                    assert [d["name"] for d in rows] == seen, name
                    break


async def test_tasks_stay_in_scope(fleet: Fleet, tmp_path: Path) -> None:
    step = {"skill": "list_tools", "args": {}}
    async with fleet.http(fleet.scoped) as http:
        refused(await http.post("/tasks", json={"plan": [step], "device": "dev2"}))
        refused(await http.post("/tasks", json={"plan": [{**step, "device": "dev2"}], "device": "dev1"}))
        refused(await http.post("/tasks", json={"plan": [step], "device": "dev1", "devices": ["dev2"]}))
        refused(await http.post("/tasks", json={"plan": [step], "requires": {"name": "dev2"}}), 409)
        refused(await http.post("/tasks/dry-run", json={"plan": [step], "device": "dev2"}))
        # a step on every device: the fan-out reaches dev1 only
        made = await http.post("/tasks", json={"plan": [{**step, "on": "all"}], "device": "dev1"})
        assert made.status_code == 201, made.text
        mine = made.json()["id"]
    done = await fleet.agent.finished(mine)
    assert done["state"] == "done", done
    [record] = done["steps"]
    assert [d["device"] for d in record["result"]["result"]["devices"]] == ["dev1"]
    # a step the planner (an LLM) puts on dev2 later: the task's dispatcher refuses it, nothing is sent
    tasks = fleet.agent.tasks
    [result] = await tasks._dispatcher(tasks.get(mine), "dev2").execute_commands([Command(**LIST_TOOLS)])
    assert not result.ok and "outside the scope of the token that created the task" in (result.error or "")
    assert not [r for r in fleet.agent.store.audit.rows(device="dev2") if r["requested_by"].startswith("task:")]
    # the admin's task on dev2: not there for the scoped token, whatever it asks
    async with fleet.http(fleet.admin) as admin:
        made = await admin.post("/tasks", json={"plan": [step], "device": "dev2"})
        assert made.status_code == 201, made.text
        theirs = made.json()["id"]
    await fleet.agent.finished(theirs)
    async with fleet.http(fleet.scoped) as http:
        assert (await http.get(f"/tasks/{mine}")).status_code == 200
        refused(await http.get(f"/tasks/{theirs}"))
        refused(await http.get(f"/tasks/{theirs}/events"))
        refused(await http.post(f"/tasks/{theirs}/cancel"))
        refused(await http.post(f"/tasks/{theirs}/undo"))
        refused(await http.post(f"/tasks/{theirs}/answer", json={"answer": "yes"}))
        refused(await http.post(f"/tasks/{theirs}/approval", json={"approved": True}))
        assert [t["id"] for t in (await http.get("/tasks")).json()] == [mine]


async def test_the_mcp_gateway_lists_and_calls_dev1_only(fleet: Fleet) -> None:
    async with fleet.http(fleet.admin) as admin:
        made = await admin.post("/tasks", json={"plan": [{"skill": "list_tools", "args": {}}], "device": "dev2"})
        theirs = made.json()["id"]
    await fleet.agent.finished(theirs)
    async with mcp_client(f"{fleet.base}/mcp", fleet.admin) as client:
        everything = [t.name for t in (await client.list_tools()).tools]
    victim = "dev2__get_system_info"
    assert victim in everything, everything
    # asking for dev2's tools with the filter does not widen the scope
    for url in (f"{fleet.base}/mcp", f"{fleet.base}/mcp?devices=dev2", f"{fleet.base}/mcp?devices=*"):
        async with mcp_client(url, fleet.scoped) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            assert not any(n.startswith("dev2__") for n in names), names
            assert url.endswith("dev2") or any(n.startswith("dev1__") for n in names), names
    async with mcp_client(f"{fleet.base}/mcp", fleet.scoped) as client:
        called = await client.call_tool(victim, {})
        assert called.is_error and "scope of token 'attacker'" in text(called), text(called)
        mine = await client.call_tool(victim.replace("dev2__", "dev1__", 1), {})
        assert not mine.is_error, text(mine)
        devices = await client.call_tool("list_devices", {})
        assert [d["name"] for d in (devices.structured_content or {})["devices"]] == ["dev1"]
        fanned = await client.call_tool("run_on_fleet", {"tool": "list_tools"})
        assert [d["device"] for d in (fanned.structured_content or {})["devices"]] == ["dev1"], text(fanned)
        by_tag = await client.call_tool("run_on_fleet", {"tool": "list_tools", "requires": {"tags": ["red"]}})
        assert by_tag.is_error and "scope" in text(by_tag), text(by_tag)
        for tool, arguments in (("get_task", {"task_id": theirs}), ("cancel_task", {"task_id": theirs}),
                                ("answer_task", {"task_id": theirs, "answer": "yes"}),
                                ("run_task", {"plan": [{"skill": "list_tools", "args": {}}], "device": "dev2"})):
            result = await client.call_tool(tool, arguments)
            assert result.is_error and "scope" in text(result), (tool, text(result))


def text(result: types.CallToolResult) -> str:
    return " ".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def test_only_a_token_reaching_dev2_answers_its_question(asking_fleet: Fleet) -> None:
    fleet = asking_fleet
    body = {"commands": [{"tool_name": "ask", "parameters": {"question": "Which colour?"}}], "timeout": 60}
    async with fleet.http(fleet.admin) as admin, fleet.http(fleet.scoped) as attacker, \
            admin.stream("POST", "/devices/dev2/commands", json=body,
                         headers={"Accept": "text/event-stream"}) as stream:
        assert stream.status_code == 200
        async for event, data in async_sse_events(stream.aiter_lines()):
            if event == "event":
                if data["kind"] == "elicitation":
                    url = f"/devices/dev2/questions/{data['data']['id']}"
                    answer = {"action": "accept", "content": {"colour": "red"}}
                    refused(await attacker.post(url, json=answer))  # approve scope, but not dev2's
                    # nor can it cancel the batch that asked (its id is in the admin's stream)
                    refused(await attacker.delete(f"/batches/{stream.headers['x-tether-batch']}"))
                    ok = await admin.post(url, json={"action": "accept", "content": {"colour": "green"}})
                    assert ok.status_code == 200, ok.text
            elif event == "results":
                [result] = data["results"]
                break
    assert result["status"] == "success" and "accept: green" in json.dumps(result["result"]), result


async def test_the_token_mcp_config_device_makes_reaches_that_device_only(fleet: Fleet) -> None:
    """The attack as found: take the token `tether mcp config --device dev1` prints, drop the URL's filter."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200", "TETHER_SERVER": fleet.base, "TETHER_TOKEN": fleet.admin}
    proc = await asyncio.create_subprocess_exec(
        *CLI, "mcp", "config", "--client", "claude-code", "--device", "dev1", env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode == 0, err.decode()
    assert "reaching devices dev1" in err.decode()
    entry = json.loads(out)["mcpServers"]["tether"]
    assert entry["headers"]["Authorization"] == "Bearer ${TETHER_MCP_TOKEN}"  # the file names the variable
    [secret] = re.findall(r"export TETHER_MCP_TOKEN='([^']+)'", err.decode())
    async with mcp_client(f"{fleet.base}/mcp", secret) as client:  # no ?devices= this time
        names = [t.name for t in (await client.list_tools()).tools]
        assert "dev1__get_system_info" in names and not any(n.startswith("dev2__") for n in names), names
    async with fleet.http(secret) as http:
        refused = await http.post("/devices/dev2/commands", json={"commands": [LIST_TOOLS]})
        assert refused.status_code == 404 and "scope of token 'mcp-claude-code'" in refused.json()["error"]


def test_token_create_scopes_an_api_token_to_devices_and_tags(tmp_path: Path) -> None:
    db = str(tmp_path / "server.db")
    env = {**os.environ, "TETHER_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1", "COLUMNS": "200"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "token", *args, "--db", db], capture_output=True, text=True, env=env,
                              timeout=WAIT, stdin=subprocess.DEVNULL)

    made = cli("create", "--api", "ci", "--device", "dev1", "--device", "lab-*", "--tag", "gpu", "--json")
    assert made.returncode == 0, made.stderr
    assert (json.loads(made.stdout)["devices"], json.loads(made.stdout)["tags"]) == (["dev1", "lab-*"], ["gpu"])
    # without --api, --device names a device token: one, and no tags (tests/agent/test_confirm.py makes one)
    refused = cli("create", "--device", "a", "--device", "b")
    assert refused.returncode != 0 and "--api NAME" in refused.stderr and "Traceback" not in refused.stderr
    listed = cli("list")
    assert listed.returncode == 0 and "devices dev1, lab-*; tags gpu" in listed.stdout, listed.stdout
