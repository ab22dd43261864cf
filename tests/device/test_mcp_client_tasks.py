"""An external MCP server's question during a task on a server: a task event, answered with the
task's own answer endpoint (what `tether answer` posts); progress arrives as task events too."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from bench.kit.fake_llm import FakeLLM
from tests.kits.task import WAIT, AgentServer
from tether.device.config import parse_device_config
from tether.device.link.connection import DeviceConnection, LinkHooks
from tether.device.link.outbox import Outbox
from tether.device.local import build_device
from tether.device.mcp.client.client_caps import MCPClientHooks
from tether.device.mcp.client.elicit import RemoteQuestions, RemoteSampler
from tether.device.probe import collect_profile
from tether.tools.policy.model import Policy

INTERACTIVE = str(Path(__file__).parent.parent / "servers" / "interactive.py")


async def add_interactive_device(server: AgentServer, name: str, tmp_path: Path, policy: Policy | None = None
                                 ) -> None:
    """A device hosting the interactive MCP server, answering its questions through the server as
    `tether device` does."""
    config = parse_device_config({"mcpServers": {"interactive": {"command": sys.executable,
                                                                 "args": [INTERACTIVE]}}})
    policy = policy or Policy()
    questions, outbox = RemoteQuestions(), Outbox()
    sampler = RemoteSampler(outbox.put_control, name) if policy.mcp_sampling != "off" else None
    hooks = MCPClientHooks(elicit=questions.elicit, sample=sampler.sample if sampler else None)
    device = build_device(config, policy=policy, state_dir=tmp_path / f"state-{name}",
                          client_id=name, sandbox=False, mcp_hooks=hooks)
    token = server.store.tokens.create("device", name)[1]
    link = DeviceConnection(device.client, f"ws://127.0.0.1:{server.port}/aip", token, name=name,
                            profile=lambda: collect_profile(device), outbox=outbox,
                            hooks=LinkHooks(questions=questions, sampler=sampler))
    job = asyncio.create_task(link.run())
    server.devices.append((device, link, job))
    await asyncio.wait_for(link.connected.wait(), WAIT)


def step(skill: str, **args: Any) -> dict[str, Any]:
    return {"skill": skill, "args": args, "description": skill}


async def test_a_question_in_a_task_is_answered_like_the_tasks_own(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        await add_interactive_device(server, "alpha", tmp_path)
        created = await server.create(request="count and ask", device="alpha",
                                      plan=[step("count", steps=2), step("ask", question="Which colour?")])
        task_id = created["id"]
        asked = await server.events_until(task_id, lambda e: e["kind"] == "elicitation")
        question = asked[-1]["data"]
        assert question["message"] == "Which colour?" and question["device"] == "alpha"
        progress = [e["data"] for e in asked if e["kind"] == "progress"]
        assert [(p["progress"], p["total"], p["step"]) for p in progress] == [(1, 2, 0), (2, 2, 0)]
        agent = {"Authorization": f"Bearer {server.agent_token}"}
        refused = await server.api.post(f"/tasks/{task_id}/answer", json={"answer": "red"}, headers=agent)
        assert refused.status_code == 403 and "approve" in refused.json()["error"]
        answered = await server.api.post(f"/tasks/{task_id}/answer", json={"answer": "teal"})
        assert answered.status_code == 200, answered.text
        task = await server.finished(task_id)
    assert task["state"] == "done", task["error"]
    assert "accept: teal" in str(task["steps"][1]["result"]["result"])


async def test_a_question_in_a_task_can_be_declined(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        await add_interactive_device(server, "alpha", tmp_path)
        created = await server.create(request="ask", device="alpha", plan=[step("ask", question="Which?")])
        await server.events_until(created["id"], lambda e: e["kind"] == "elicitation")
        answered = await server.api.post(f"/tasks/{created['id']}/answer", json={"answer": "decline"})
        assert answered.status_code == 200, answered.text
        task = await server.finished(created["id"])
        again = await server.api.post(f"/tasks/{created['id']}/answer", json={"answer": "teal"})
    assert "decline" in str(task["steps"][0]["result"]["result"])
    assert again.status_code == 409 and "error" in again.json()


async def test_sampling_uses_the_servers_llm_when_the_device_policy_allows_it(tmp_path: Path) -> None:
    async with FakeLLM(["a deep blue", "done", "done"]) as fake, \
            AgentServer(tmp_path, llm=fake.settings()) as server:
        await add_interactive_device(server, "alpha", tmp_path, Policy(mcp_sampling="on"))
        created = await server.create(request="sample", device="alpha",
                                      plan=[step("sample", prompt="name a colour")])
        task = await server.finished(created["id"])
    assert task["steps"][0]["result"]["status"] == "success", task["steps"][0]["result"]
    assert "a deep blue" in str(task["steps"][0]["result"]["result"])
    assert fake.requests[0]["messages"][-1]["content"] == "name a colour"


async def test_sampling_is_refused_without_an_llm_on_the_server(tmp_path: Path) -> None:
    async with AgentServer(tmp_path) as server:
        await add_interactive_device(server, "alpha", tmp_path, Policy(mcp_sampling="on"))
        created = await server.create(request="sample", device="alpha",
                                      plan=[step("sample", prompt="name a colour")])
        events = await server.events_until(created["id"], lambda e: e["kind"] == "step_finished")
        await server.api.post(f"/tasks/{created['id']}/cancel")  # without an LLM, recovery would ask a person
    finished = events[-1]["data"]
    assert finished["status"] == "failure" and "this server has no LLM configured" in finished["error"]


async def test_tether_answer_answers_an_mcp_servers_question(tmp_path: Path) -> None:
    from tests.kits.netutil import CLI, tether_env

    async with AgentServer(tmp_path) as server:
        await add_interactive_device(server, "alpha", tmp_path)
        created = await server.create(request="ask", device="alpha", plan=[step("ask", question="Which colour?")])
        await server.events_until(created["id"], lambda e: e["kind"] == "elicitation")
        env = {**tether_env(tmp_path / "cli"), "TETHER_SERVER": f"http://127.0.0.1:{server.port}",
               "TETHER_TOKEN": server.token}
        proc = await asyncio.create_subprocess_exec(*CLI, "answer", created["id"], "amber", env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, (out + err).decode()
        task = await server.finished(created["id"])
    assert task["state"] == "done", task["error"]
    assert "accept: amber" in str(task["steps"][0]["result"]["result"])
