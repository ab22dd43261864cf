"""The device as a complete MCP client: progress, elicitation, roots, sampling and logs, against a
real stdio MCP server (tests/servers/interactive.py) and a real HTTP LLM (bench/kit/fake_llm.py)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.kit.fake_llm import FakeLLM
from tether.agent.llm.chat import LLMClient
from tether.device.mcp.client.client_caps import (
    ElicitationAnswer,
    ElicitationRequest,
    check_answer,
)
from tether.device.mcp.client.manager import BaseMCPServer, MCPServerManager
from tether.protocol.models import ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy

INTERACTIVE = str(Path(__file__).parent.parent / "servers" / "interactive.py")


def config(namespace: str = "interactive") -> dict[str, Any]:
    return {"namespace": namespace, "server_type": "stdio", "command": sys.executable, "args": [INTERACTIVE],
            "startup_timeout": 20}


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        self.items.append((kind, data))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.items if k == kind]


def ctx_for(events: Events, policy: Policy | None = None) -> ToolContext:
    return ToolContext(policy=policy or Policy(), call_id="c1", session_id="s1", emit=events)


@pytest.fixture
async def manager() -> AsyncIterator[MCPServerManager]:
    mgr = MCPServerManager(context=ToolContext(policy=Policy()))
    yield mgr
    await mgr.aclose()


async def started(mgr: MCPServerManager) -> BaseMCPServer:
    server = mgr.create_or_get_server(config())
    assert await mgr.start_servers([server]) == {}
    return server


async def test_progress_notifications_become_events_of_the_call(manager: MCPServerManager) -> None:
    server = await started(manager)
    events = Events()
    result = await server.call_tool("count", {"steps": 3}, ctx=ctx_for(events), timeout=20)
    assert result.status == ResultStatus.SUCCESS, result.error
    progress = events.of("progress")
    assert [(p["progress"], p["total"], p["message"]) for p in progress] == [
        (1, 3, "step 1 of 3"), (2, 3, "step 2 of 3"), (3, 3, "step 3 of 3")]
    assert all(p["call_id"] == "c1" and p["server"] == "interactive" and p["tool"] == "count" for p in progress)


async def test_a_question_is_answered_by_the_hook(manager: MCPServerManager) -> None:
    asked: list[ElicitationRequest] = []

    async def answer(request: ElicitationRequest) -> ElicitationAnswer:
        asked.append(request)
        return ElicitationAnswer("accept", {"colour": "blue"})

    manager.hooks.elicit = answer
    server = await started(manager)
    events = Events()
    result = await server.call_tool("ask", {"question": "Which colour?"}, ctx=ctx_for(events), timeout=20)
    assert result.status == ResultStatus.SUCCESS, result.error
    assert "accept: blue" in str(result.result)
    [request] = asked
    assert request.message == "Which colour?" and request.call_id == "c1" and request.server == "interactive"
    assert "colour" in request.schema["properties"]
    [shown] = events.of("elicitation")
    assert shown["id"] == request.id and shown["message"] == "Which colour?"
    assert events.of("elicitation_answered") == [{"id": request.id, "call_id": "c1", "server": "interactive",
                                                   "action": "accept"}]


async def test_nobody_to_ask_declines(manager: MCPServerManager) -> None:
    server = await started(manager)
    events = Events()
    result = await server.call_tool("ask", {"question": "Which colour?"}, ctx=ctx_for(events), timeout=20)
    assert result.status == ResultStatus.SUCCESS, result.error
    assert "decline" in str(result.result)
    assert events.of("elicitation")  # the question is still shown on the command's stream


async def test_an_unanswered_question_is_cancelled_after_its_timeout(manager: MCPServerManager) -> None:
    never = asyncio.Event()
    asked = asyncio.Event()

    async def wait_forever(request: ElicitationRequest) -> ElicitationAnswer:
        asked.set()
        await never.wait()
        raise AssertionError("unreachable")

    manager.hooks.elicit = wait_forever
    manager.hooks.elicit_timeout = 0.3
    server = await started(manager)
    result = await server.call_tool("ask", {"question": "Which colour?"}, ctx=ctx_for(Events()), timeout=20)
    assert asked.is_set()
    assert result.status == ResultStatus.SUCCESS, result.error
    assert "cancel" in str(result.result)


async def test_an_answer_that_does_not_fit_the_schema_is_not_sent(manager: MCPServerManager) -> None:
    async def wrong(request: ElicitationRequest) -> ElicitationAnswer:
        return ElicitationAnswer("accept", {"colour": 7})

    manager.hooks.elicit = wrong
    server = await started(manager)
    result = await server.call_tool("ask", {"question": "Which colour?"}, ctx=ctx_for(Events()), timeout=20)
    assert "cancel" in str(result.result)


def test_check_answer() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                               "c": {"type": "string", "enum": ["a", "b"]}}, "required": ["n"]}
    assert check_answer(schema, {"n": 1, "ok": True, "c": "a"}) is None
    assert check_answer(schema, {}) == "missing n"
    assert check_answer(schema, {"n": True}) == "n: expected integer"
    assert check_answer(schema, {"n": 1, "c": "z"}) is not None
    assert check_answer(schema, {"n": 1, "x": 1}) == "unknown field 'x'"


async def test_roots_are_the_policys_roots(tmp_path: Path) -> None:
    write, read = tmp_path / "w", tmp_path / "r"
    write.mkdir()
    read.mkdir()
    policy = Policy(write_roots=[str(write)], read_roots=[str(read), str(write)])
    mgr = MCPServerManager(context=ToolContext(policy=policy))
    try:
        server = await started(mgr)
        result = await server.call_tool("roots", {}, ctx=ctx_for(Events(), policy), timeout=20)
        assert result.status == ResultStatus.SUCCESS, result.error
        text = str(result.result["structured"])
        assert write.as_uri() in text and read.as_uri() in text
        assert text.count(write.as_uri()) == 1  # listed once
        await mgr.roots_changed(ToolContext(policy=Policy(write_roots=[str(read)], read_roots=[])))
        again = await server.call_tool("roots", {}, ctx=ctx_for(Events(), Policy(write_roots=[str(read)],
                                                                                read_roots=[])), timeout=20)
        assert write.as_uri() not in str(again.result) and read.as_uri() in str(again.result)
    finally:
        await mgr.aclose()


async def test_log_messages_reach_the_device_log_at_their_level(manager: MCPServerManager,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tether.mcp.interactive")
    server = await started(manager)
    result = await server.call_tool("chatter", {}, ctx=ctx_for(Events()), timeout=20)
    assert result.status == ResultStatus.SUCCESS, result.error
    mine = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "tether.mcp.interactive"]
    assert (logging.DEBUG, "debug line from interactive") in [(lv, m.split(": ")[-1]) for lv, m in mine]
    assert (logging.INFO, "info line from interactive") in [(lv, m.split(": ")[-1]) for lv, m in mine]
    assert (logging.WARNING, "warning line from interactive") in [(lv, m.split(": ")[-1]) for lv, m in mine]


async def test_sampling_is_refused_by_the_default_policy(manager: MCPServerManager) -> None:
    async with FakeLLM(["never used"]) as fake, LLMClient(fake.settings()) as llm:
        from tether.cli.local.mcp_hooks import llm_sampler

        manager.hooks.sample = llm_sampler(llm)
        server = await started(manager)
        events = Events()
        result = await server.call_tool("sample", {"prompt": "hi"}, ctx=ctx_for(events), timeout=20)
        assert result.status == ResultStatus.FAILURE
        assert "refused by this device's policy (mcp_sampling)" in str(result.error)
        assert fake.requests == []
        assert events.of("sampling")[0]["refused"] == "policy"


async def test_sampling_allowed_by_policy_asks_the_llm(manager: MCPServerManager) -> None:
    async with FakeLLM(["forty-two"]) as fake, LLMClient(fake.settings()) as llm:
        from tether.cli.local.mcp_hooks import llm_sampler

        manager.hooks.sample = llm_sampler(llm)
        server = await started(manager)
        events = Events()
        result = await server.call_tool("sample", {"prompt": "what is six times seven?"},
                                        ctx=ctx_for(events, Policy(mcp_sampling="on")), timeout=20)
        assert result.status == ResultStatus.SUCCESS, result.error
        assert "forty-two" in str(result.result)
        [request] = fake.requests
        assert request["messages"][-1]["content"] == "what is six times seven?"
        assert request["max_tokens"] == 50  # the server's maxTokens is passed on
        assert events.of("sampling")[0]["chars"] == len("forty-two")


async def test_sampling_is_not_declared_without_an_llm(manager: MCPServerManager) -> None:
    server = await started(manager)
    result = await server.call_tool("sample", {"prompt": "hi"}, ctx=ctx_for(Events(), Policy(mcp_sampling="on")),
                                    timeout=20)
    assert result.status == ResultStatus.FAILURE


async def test_sampling_in_ask_mode_asks_a_person_first(manager: MCPServerManager) -> None:
    answers = ["decline", "accept"]
    asked: list[str] = []

    async def person(request: ElicitationRequest) -> ElicitationAnswer:
        asked.append(request.message)
        return ElicitationAnswer(answers.pop(0), {} if not answers else None)  # type: ignore[arg-type]

    async with FakeLLM(["sure"]) as fake, LLMClient(fake.settings()) as llm:
        from tether.cli.local.mcp_hooks import llm_sampler

        manager.hooks.sample = llm_sampler(llm)
        manager.hooks.elicit = person
        server = await started(manager)
        policy = Policy(mcp_sampling="ask")
        refused = await server.call_tool("sample", {"prompt": "hi"}, ctx=ctx_for(Events(), policy), timeout=20)
        assert refused.status == ResultStatus.FAILURE and "declined by the person" in str(refused.error)
        assert fake.requests == []
        allowed = await server.call_tool("sample", {"prompt": "hi"}, ctx=ctx_for(Events(), policy), timeout=20)
        assert allowed.status == ResultStatus.SUCCESS, allowed.error
        assert "sure" in str(allowed.result)
    assert len(asked) == 2 and "asks to send 1 message(s) to the LLM" in asked[0]


async def test_sampling_is_budgeted_per_command(manager: MCPServerManager) -> None:
    from tether.device.mcp.client.client_caps import MAX_SAMPLING_CALLS, SamplingReply, SamplingRequest

    calls: list[SamplingRequest] = []

    async def count(request: SamplingRequest) -> SamplingReply:
        calls.append(request)
        return SamplingReply(text="ok", model="counter")

    manager.hooks.sample = count
    server = await started(manager)
    ctx = ctx_for(Events(), Policy(mcp_sampling="on"))
    caps = server.caps  # type: ignore[attr-defined]
    with caps.tracking(ctx):  # one command whose calls all count against one budget
        results = [await server.call_tool("sample", {"prompt": "hi"}, ctx=ctx, timeout=20)
                   for _ in range(MAX_SAMPLING_CALLS + 1)]
    assert [r.status for r in results[:MAX_SAMPLING_CALLS]] == [ResultStatus.SUCCESS] * MAX_SAMPLING_CALLS
    assert results[-1].status == ResultStatus.FAILURE and "budget spent" in str(results[-1].error)
    assert len(calls) == MAX_SAMPLING_CALLS
