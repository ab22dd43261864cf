"""Progress, cancellation and contributed tools through the gateway, with a scripted device that sends exactly
the frames a test says (the real device's side is in test_gateway_device.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import pytest
from fastapi import FastAPI
from mcp.shared.exceptions import MCPError

from tests.kits.aip import WAIT
from tests.kits.gateway import GatewayServer, mcp_client, register
from tether.protocol.messages import ClientMessage, ClientMessageType, Event, ServerMessageType
from tether.protocol.models import Result, ResultStatus
from tether.server.mcp.contributed import GatewayCall, GatewayReply, GatewayTool, contribute


def ask_and_report(app: FastAPI) -> AbstractAsyncContextManager[None]:
    """An extension as the agent's is: it contributes tools when the app is built."""

    async def ask(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        await call.progress(1, 2, "thinking")
        if call.elicit is None:
            return GatewayReply(f"{call.client} cannot be asked; answer with answer_task", is_error=True)
        answer = await call.elicit("Which colour?", {"type": "object", "properties": {
            "colour": {"type": "string", "enum": ["red", "blue"]}}, "required": ["colour"]})
        await call.progress(2, 2, "done")
        return GatewayReply(f"{call.token.name} chose {answer['content']['colour']}",
                            {"colour": answer["content"]["colour"]})

    async def boom(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        raise RuntimeError("a bug")

    contribute(app, [
        GatewayTool("ask_colour", "Ask a person for a colour", {"type": "object", "properties": {}}, "execute", ask,
                    output_schema={"type": "object", "properties": {"colour": {"type": "string"}}}),
        GatewayTool("answer_it", "Needs approve", {"type": "object", "properties": {}}, "approve", ask),
        GatewayTool("boom", "Fails", {"type": "object", "properties": {}}, "read", boom, read_only=True)])

    @asynccontextmanager
    async def running() -> AsyncIterator[None]:
        yield

    return running()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path, extensions=[ask_and_report]).start()
    yield running
    await running.stop()


class Progress:
    def __init__(self, until: int) -> None:
        self.seen: list[tuple[float, float | None, str | None]] = []
        self.until, self.enough = until, asyncio.Event()

    async def __call__(self, progress: float, total: float | None, message: str | None) -> None:
        self.seen.append((progress, total, message))
        if len(self.seen) >= self.until:
            self.enough.set()


def colour(answer: str) -> Callable[..., Any]:
    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        assert params.message == "Which colour?"
        return types.ElicitResult(action="accept", content={"colour": answer})

    return elicitation


async def test_contributed_tools_are_listed_and_called_with_progress_and_elicitation(server: GatewayServer) -> None:
    async with mcp_client(server.mcp_url, server.token("agent", "execute"), elicitation_callback=colour("blue"),
                          client_info=types.Implementation(name="ide", version="2.1")) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert {"ask_colour", "answer_it", "boom", "list_devices"} <= set(listed)
        assert listed["boom"].annotations is not None and listed["boom"].annotations.read_only_hint is True
        progress = Progress(2)
        result = await client.call_tool("ask_colour", {}, progress_callback=progress)
        assert not result.is_error and result.structured_content == {"colour": "blue"}
        assert result.content[0].text == "agent chose blue"
        assert progress.seen == [(1, 2, "thinking"), (2, 2, "done")]
        refused = await client.call_tool("answer_it", {})
        assert refused.is_error and "lacks the 'approve' scope" in refused.content[0].text
        failed = await client.call_tool("boom", {})
        assert failed.is_error and "server log" in failed.content[0].text


async def test_a_client_without_elicitation_is_told_at_once(server: GatewayServer) -> None:
    async with mcp_client(server.mcp_url, server.token("agent", "execute"),
                          client_info=types.Implementation(name="cli", version="1")) as client:
        result = await client.call_tool("ask_colour", {})
        assert result.is_error and result.content[0].text == "cli/1 cannot be asked; answer with answer_task"


async def test_streamed_output_and_mcp_progress_reach_the_client(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")

    async def device_side() -> None:
        command = await laptop.expect(ServerMessageType.COMMAND)
        [call] = command.actions or []
        for kind, data in (("output", {"stream": "stdout", "data": "line 1\nline 2\n"}),
                           ("progress", {"server": "everything", "tool": "longRunningOperation", "progress": 3,
                                         "total": 10, "message": "step 3"})):
            event = Event(kind=kind, response_id=command.response_id, call_id=call.call_id, data=data)
            await laptop.send(ClientMessage(type=ClientMessageType.EVENT, payload=event.model_dump()))
        await laptop.results(command.response_id, [Result(status=ResultStatus.SUCCESS, call_id=call.call_id,
                                                          result="line 1\nline 2\n")])

    async with mcp_client(server.mcp_url, server.token("agent", "execute")) as client:
        device = asyncio.create_task(device_side())
        progress = Progress(2)
        result = await client.call_tool("laptop__files.read", {"path": "x"}, progress_callback=progress)
        await asyncio.wait_for(device, WAIT)
        assert not result.is_error and result.content[0].text == "line 1\nline 2\n"
        # the external server's own progress passes as it sent it: value, total, message
        assert progress.seen == [(1.0, None, "line 1\nline 2\n"), (3.0, 10.0, "step 3")]
    await laptop.close()


async def test_the_clients_cancellation_cancels_the_batch_on_the_device(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")
    async with mcp_client(server.mcp_url, server.token("agent", "execute")) as client:
        async with anyio.create_task_group() as group:
            group.start_soon(client.call_tool, "laptop__shell.run", {"cmd": "sleep", "timeoutMs": 120_000})
            command = await laptop.expect(ServerMessageType.COMMAND)
            assert command.timeout == 121, "the batch waits a second longer than the tool's own timeout"
            group.cancel_scope.cancel()  # the SDK sends notifications/cancelled for the abandoned request
        cancel = await laptop.expect(ServerMessageType.CANCEL)
        assert cancel.response_id == command.response_id
    [row] = server.store.audit.rows(device="laptop")
    assert row["status"] == "failure" and "cancelled by the MCP client" in row["error"]
    await laptop.close()


async def test_a_cancelled_request_gets_no_response(server: GatewayServer) -> None:
    """MCP 2025-11-25: the receiver of notifications/cancelled does not answer the cancelled request (the SDK
    would send -32800): its stream ends with nothing after what it had sent."""
    laptop = await register(server, "laptop")
    headers = {"Authorization": f"Bearer {server.token('agent', 'execute')}", "Content-Type": "application/json",
               "Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-11-25"}
    async with httpx2.AsyncClient(timeout=WAIT * 4) as http:
        opened = await http.post(server.mcp_url, headers=headers, json={
            "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}})
        headers["Mcp-Session-Id"] = opened.headers["mcp-session-id"]
        await http.post(server.mcp_url, headers=headers, json={"jsonrpc": "2.0",
                                                               "method": "notifications/initialized"})
        call = asyncio.create_task(http.post(server.mcp_url, headers=headers, json={
            "jsonrpc": "2.0", "id": 2, "method": "tools/call",
            "params": {"name": "laptop__shell.run", "arguments": {"cmd": "sleep"}}}))
        command = await laptop.expect(ServerMessageType.COMMAND)
        told = await http.post(server.mcp_url, headers=headers, json={
            "jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 2, "reason": "enough"}})
        assert told.status_code == 202
        assert (await laptop.expect(ServerMessageType.CANCEL)).response_id == command.response_id
        answer = await asyncio.wait_for(call, WAIT * 4)
        assert answer.status_code == 200 and '"id":2' not in answer.text.replace(" ", ""), answer.text
        assert "-32800" not in answer.text
    await laptop.close()


async def test_an_external_servers_question_is_asked_of_the_client(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")

    async def device_side() -> Any:
        command = await laptop.expect(ServerMessageType.COMMAND)
        [call] = command.actions or []
        question = Event(kind="elicitation", response_id=command.response_id, call_id=call.call_id, data={
            "id": "q1", "server": "everything", "call_id": call.call_id, "message": "Which colour?",
            "schema": {"type": "object", "properties": {"colour": {"type": "string"}}}})
        await laptop.send(ClientMessage(type=ClientMessageType.EVENT, payload=question.model_dump()))
        answer = await laptop.expect(ServerMessageType.ELICITATION_ANSWER)
        await laptop.results(command.response_id, [Result(status=ResultStatus.SUCCESS, call_id=call.call_id,
                                                          result={"picked": answer.payload["content"]["colour"]})])
        return answer

    asked: list[str] = []

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"colour": "red"})

    async with mcp_client(server.mcp_url, server.token("person", "execute", "approve"),
                          elicitation_callback=elicitation) as client:
        device = asyncio.create_task(device_side())
        result = await client.call_tool("laptop__files.read", {"path": "x"})
        answer = await asyncio.wait_for(device, WAIT)
    assert not result.is_error and result.structured_content == {"picked": "red"}
    assert asked == ["everything on device laptop asks: Which colour?"]
    assert answer.payload == {"id": "q1", "action": "accept", "content": {"colour": "red"}}
    await laptop.close()


async def test_a_revoked_token_is_refused_on_its_next_request(server: GatewayServer) -> None:
    token = server.token("soon-gone", "read")
    async with mcp_client(server.mcp_url, token) as client:
        assert "list_devices" in {t.name for t in (await client.list_tools()).tools}
        server.store.tokens.revoke("soon-gone")
        with pytest.raises(MCPError):  # the SDK reports the HTTP error without its status
            await client.list_tools()
    async with httpx2.AsyncClient(timeout=WAIT) as http:
        refused = await http.post(server.mcp_url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                                  headers={"Authorization": f"Bearer {token}"})
    assert refused.status_code == 401 and refused.json() == {"error": "unknown or revoked token"}


def test_tool_names_keep_legal_characters_and_escape_the_rest() -> None:
    from tether.server.mcp.listing import DeviceFilter, mcp_name

    assert mcp_name("laptop", "shell.run") == "laptop__shell.run"
    assert mcp_name("lab-1", "git_status") == "lab-1__git_status"
    assert mcp_name("me@laptop", "tool é") == "me-40laptop__tool-20-C3-A9"
    keep = DeviceFilter.parse("laptop, lab-*")
    assert keep.admits("lab-7") and keep.admits("laptop") and not keep.admits("desk")
    assert DeviceFilter.parse(None).admits("anything") and not DeviceFilter.parse("none").admits("laptop")


async def test_new_tools_reported_by_a_device_are_listed_and_announced(server: GatewayServer) -> None:
    from tests.kits.gateway import READ_FILE, SHELL_RUN, Seen, profile
    from tether.protocol.models import ToolInfo

    laptop = await register(server, "laptop", profile(SHELL_RUN))
    seen = Seen()
    async with mcp_client(server.mcp_url, server.token("reader", "read"), message_handler=seen) as client:
        assert "laptop__files.read" not in {t.name for t in (await client.list_tools()).tools}
        git = ToolInfo(name="git_status", namespace="git", tool_type="data_collection")
        await laptop.send(ClientMessage(type=ClientMessageType.DEVICE_INFO,
                                        payload=profile(SHELL_RUN, READ_FILE, git).model_dump(mode="json")))
        await asyncio.wait_for(seen.list_changed.wait(), WAIT)
        assert {"laptop__files.read", "laptop__git_status"} <= {t.name for t in (await client.list_tools()).tools}
    await laptop.close()


async def test_a_result_past_the_answer_limit_is_replaced_by_a_clear_failure(tmp_path: Path) -> None:
    server = await GatewayServer(tmp_path, max_response_bytes=2048).start()
    laptop = await register(server, "laptop")
    answered = laptop.serve_forever(lambda c: Result(status=ResultStatus.SUCCESS, call_id=c.call_id,
                                                     result="x" * 5000))
    async with mcp_client(server.mcp_url, server.token("agent", "execute")) as client:
        big = await client.call_tool("laptop__files.read", {"path": "big"})
    assert big.is_error and "result too large" in big.content[0].text and "2048" in big.content[0].text
    answered.cancel()
    await laptop.close()
    await server.stop()
