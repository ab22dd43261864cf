"""How the gateway answers each request (server/mcp/front/transport.py): a JSON body when the call has nothing to send
before its result, an SSE stream when it has (progress, a question) or stays silent too long, and the SDK's
own stream for a cancelled call. The official SDK client reads every answer; an httpx event hook records the
Content-Type of each POST's answer, by JSON-RPC method."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from tests.kits.aip import WAIT
from tests.kits.gateway import GatewayServer, register
from tether.protocol.messages import ClientMessage, ClientMessageType, Event, ServerMessageType
from tether.protocol.models import Result, ResultStatus

SSE, JSON = "text/event-stream", "application/json"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path).start()
    yield running
    await running.stop()


class Answers:
    """The Content-Type of each POST's answer, with the JSON-RPC method it answered; `streamed` is set when an
    SSE answer's headers arrive (before its body)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.streamed = asyncio.Event()

    async def __call__(self, response: httpx2.Response) -> None:
        request = response.request
        if request.method != "POST":
            return
        method = json.loads(request.content).get("method", "")
        kind = response.headers.get("content-type", "").split(";")[0]
        self.seen.append((method, kind))
        if kind == SSE:
            self.streamed.set()

    def of(self, method: str) -> list[str]:
        return [kind for seen, kind in self.seen if seen == method]


@contextlib.asynccontextmanager
async def client(server: GatewayServer, answers: Answers, **session: Any) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {server.token('agent', 'execute', 'approve')}"}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(WAIT * 6, read=300.0),
                                  event_hooks={"response": [answers]}) as http, \
            streamable_http_client(server.mcp_url, http_client=http) as (read, write), \
            ClientSession(read, write, read_timeout_seconds=60, **session) as opened:
        await opened.initialize()
        yield opened


async def test_a_call_with_nothing_to_stream_is_answered_with_one_json_body(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")
    answered = laptop.serve_forever(lambda c: Result(status=ResultStatus.SUCCESS, call_id=c.call_id,
                                                     result={"exitCode": 0}))
    answers = Answers()
    async with client(server, answers) as session:
        listed = {t.name for t in (await session.list_tools()).tools}
        assert "laptop__shell.run" in listed
        result = await session.call_tool("laptop__shell.run", {"cmd": "true"})
        assert not result.is_error and result.structured_content == {"exitCode": 0}
        devices = await session.call_tool("list_devices", {})
        assert not devices.is_error
        unknown = await session.call_tool("nobody__nothing", {})
        assert unknown.is_error and "no tool named" in unknown.content[0].text
    answered.cancel()
    assert answers.of("tools/list") == [JSON]
    assert answers.of("tools/call") == [JSON, JSON, JSON]
    await laptop.close()


async def test_progress_opens_a_stream_with_the_notification_first(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")

    async def device_side() -> None:
        command = await laptop.expect(ServerMessageType.COMMAND)
        [call] = command.actions or []
        event = Event(kind="output", response_id=command.response_id, call_id=call.call_id,
                      data={"stream": "stdout", "data": "half way\n"})
        await laptop.send(ClientMessage(type=ClientMessageType.EVENT, payload=event.model_dump()))
        await laptop.results(command.response_id, [Result(status=ResultStatus.SUCCESS, call_id=call.call_id,
                                                          result="done\n")])

    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    answers = Answers()
    async with client(server, answers) as session:
        device = asyncio.create_task(device_side())
        result = await session.call_tool("laptop__files.read", {"path": "x"}, progress_callback=progress)
        await asyncio.wait_for(device, WAIT)
        assert not result.is_error and result.content[0].text == "done\n"
        # a progress token alone streams nothing: no event, a JSON answer
        quiet = laptop.serve_forever(lambda c: Result(status=ResultStatus.SUCCESS, call_id=c.call_id, result="ok"))
        assert not (await session.call_tool("laptop__files.read", {"path": "y"}, progress_callback=progress)).is_error
        quiet.cancel()
    assert seen == [(1.0, None, "half way\n")]
    assert answers.of("tools/call") == [SSE, JSON]
    await laptop.close()


async def test_an_approval_asked_through_elicitation_streams_the_question(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")

    def held_until_approved(c: Any) -> Result:
        if c.approved_by:
            return Result(status=ResultStatus.SUCCESS, call_id=c.call_id, result={"exitCode": 0})
        return Result.failure("needs approval (policy rule 'ask.on-miss'): `rm x`", c.call_id, "shell",
                              {"needs_approval": True, "rule": "ask.on-miss"})

    answered = laptop.serve_forever(held_until_approved)
    asked: list[str] = []

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"decision": "approve once"})

    answers = Answers()
    async with client(server, answers, elicitation_callback=elicitation) as session:
        result = await session.call_tool("laptop__shell.run", {"cmd": "rm x"})
    answered.cancel()
    assert asked == ["Device laptop: needs approval (policy rule 'ask.on-miss'): `rm x`"]
    assert not result.is_error and result.structured_content == {"exitCode": 0}, result
    assert answers.of("tools/call") == [SSE]
    await laptop.close()


async def test_a_call_silent_past_stream_after_is_answered_on_a_stream(server: GatewayServer) -> None:
    """The answer's headers must reach the client while the device still holds the result: the device answers
    only once the client has seen the SSE answer start (no timing involved beyond the 0 s limit)."""
    (await server.app.state.gateway.ready()).manager.stream_after = 0.0
    laptop = await register(server, "laptop")
    answers = Answers()

    async def device_side() -> None:
        command = await laptop.expect(ServerMessageType.COMMAND)
        [call] = command.actions or []
        await asyncio.wait_for(answers.streamed.wait(), WAIT)
        await laptop.results(command.response_id, [Result(status=ResultStatus.SUCCESS, call_id=call.call_id,
                                                          result={"exitCode": 0})])

    async with client(server, answers) as session:
        device = asyncio.create_task(device_side())
        result = await session.call_tool("laptop__shell.run", {"cmd": "slow"})
        await asyncio.wait_for(device, WAIT)
        assert not result.is_error and result.structured_content == {"exitCode": 0}
    assert answers.of("tools/call") == [SSE]
    await laptop.close()


async def test_concurrent_calls_on_one_session_each_get_their_own_answer(server: GatewayServer) -> None:
    """Five calls at once, one of them streaming output: the device answers them in reverse order, and each
    call gets its own result, the streaming one on a stream and the others as JSON bodies."""
    laptop = await register(server, "laptop")

    async def device_side() -> None:
        commands = [await laptop.expect(ServerMessageType.COMMAND) for _ in range(5)]
        for command in reversed(commands):
            [call] = command.actions or []
            path = call.parameters["path"]
            if path == "streamed":
                event = Event(kind="output", response_id=command.response_id, call_id=call.call_id,
                              data={"stream": "stdout", "data": "some output\n"})
                await laptop.send(ClientMessage(type=ClientMessageType.EVENT, payload=event.model_dump()))
            await laptop.results(command.response_id, [Result(status=ResultStatus.SUCCESS, call_id=call.call_id,
                                                              result=f"read {path}")])

    seen: list[str | None] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append(message)

    answers = Answers()
    async with client(server, answers) as session:
        device = asyncio.create_task(device_side())
        paths = ["a", "b", "streamed", "c", "d"]
        results = await asyncio.gather(*(
            session.call_tool("laptop__files.read", {"path": path},
                              progress_callback=progress if path == "streamed" else None) for path in paths))
        await asyncio.wait_for(device, WAIT)
    assert [r.content[0].text for r in results] == [f"read {path}" for path in paths]
    assert seen == ["some output\n"]
    assert sorted(answers.of("tools/call")) == [JSON, JSON, JSON, JSON, SSE]
    await laptop.close()
