"""The device as an MCP client of a server nobody here wrote: `@modelcontextprotocol/server-everything`
(npm, installed by scripts/test), whose tools need the client's progress, roots, elicitation and
sampling capabilities."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.kit.fake_llm import FakeLLM
from tether.agent.llm.chat import LLMClient
from tether.cli.local.mcp_hooks import llm_sampler
from tether.device.mcp.client.client_caps import ElicitationAnswer, ElicitationRequest
from tether.device.mcp.client.manager import BaseMCPServer, MCPServerManager
from tether.protocol.models import ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy

REPO = Path(__file__).resolve().parents[2]
EVERYTHING = REPO / ".tether-test-node" / "node_modules" / ".bin" / "mcp-server-everything"


@pytest.fixture(scope="module")
def everything_bin() -> Path:
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH; install Node.js 20+ (e.g. `apt-get install nodejs npm`)")
    if not EVERYTHING.exists():
        pytest.fail(f"{EVERYTHING} is missing; install it from {REPO} with: npm install --prefix .tether-test-node "
                    "@modelcontextprotocol/server-everything")
    return EVERYTHING


@pytest.fixture
async def manager() -> AsyncIterator[MCPServerManager]:
    mgr = MCPServerManager(context=ToolContext(policy=Policy()))
    yield mgr
    await mgr.aclose()


async def started(mgr: MCPServerManager, binary: Path) -> BaseMCPServer:
    server = mgr.create_or_get_server({"namespace": "everything", "server_type": "stdio", "command": str(binary),
                                       "args": ["stdio"], "startup_timeout": 30})
    assert await mgr.start_servers([server]) == {}
    return server


def ctx(events: list[tuple[str, dict[str, Any]]], policy: Policy | None = None) -> ToolContext:
    return ToolContext(policy=policy or Policy(), call_id="e1", emit=lambda k, d: events.append((k, d)))


async def test_capabilities_decide_which_tools_it_offers(manager: MCPServerManager, everything_bin: Path) -> None:
    server = await started(manager, everything_bin)
    names = {t.name for t in await server.list_tools("action")}
    assert {"get-roots-list", "trigger-elicitation-request", "trigger-long-running-operation"} <= names
    assert "trigger-sampling-request" not in names  # no LLM here: sampling is not declared


async def test_progress_roots_and_a_question(manager: MCPServerManager, everything_bin: Path,
                                             tmp_path: Path) -> None:
    asked: list[ElicitationRequest] = []

    async def person(request: ElicitationRequest) -> ElicitationAnswer:
        asked.append(request)
        return ElicitationAnswer("accept", {"name": "Ada Lovelace", "check": True})

    manager.hooks.elicit = person
    manager.context = ToolContext(policy=Policy(write_roots=[str(tmp_path)], read_roots=[]))
    server = await started(manager, everything_bin)
    events: list[tuple[str, dict[str, Any]]] = []
    # the server may ask for its roots while this call runs (then they are this call's policy's): one policy
    ran = await server.call_tool("trigger-long-running-operation", {"duration": 0.3, "steps": 3},
                                 ctx=ctx(events, manager.context.policy), timeout=30)
    assert ran.status == ResultStatus.SUCCESS, ran.error
    assert [(d["progress"], d["total"]) for k, d in events if k == "progress"] == [(1, 3), (2, 3), (3, 3)]
    roots = await server.call_tool("get-roots-list", {}, ctx=ctx([], manager.context.policy), timeout=30)
    assert tmp_path.as_uri() in str(roots.result)
    answered = await server.call_tool("trigger-elicitation-request", {}, ctx=ctx([]), timeout=30)
    assert answered.status == ResultStatus.SUCCESS, answered.error
    assert "Name: Ada Lovelace" in str(answered.result) and "Agreed to terms: true" in str(answered.result)
    assert asked[0].schema["required"] == ["name"]


async def test_sampling_with_an_llm_allowed_by_policy(manager: MCPServerManager, everything_bin: Path) -> None:
    async with FakeLLM(["a haiku about tests"]) as fake, LLMClient(fake.settings()) as llm:
        manager.hooks.sample = llm_sampler(llm)
        server = await started(manager, everything_bin)
        assert "trigger-sampling-request" in {t.name for t in await server.list_tools("action")}
        refused = await server.call_tool("trigger-sampling-request", {"prompt": "write a haiku"}, ctx=ctx([]),
                                         timeout=30)
        assert fake.requests == [] and "mcp_sampling" in str(refused.error or refused.result)
        events: list[tuple[str, dict[str, Any]]] = []
        sampled = await server.call_tool("trigger-sampling-request", {"prompt": "write a haiku"},
                                         ctx=ctx(events, Policy(mcp_sampling="on")), timeout=30)
    assert sampled.status == ResultStatus.SUCCESS, sampled.error
    assert "a haiku about tests" in str(sampled.result)
    assert "write a haiku" in fake.requests[0]["messages"][-1]["content"]
    assert [d["server"] for k, d in events if k == "sampling"] == ["everything"]
