"""The MCP gateway at /mcp, driven by the official SDK client: tokens and scopes, the fleet tool, device tools
with their schemas and annotations, a call through the dispatcher with its audit row, the device filter, and
tools/list_changed as devices come and go."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.kits.aip import WAIT
from tests.kits.gateway import GatewayServer, Seen, mcp_client, profile, register
from tether.protocol.models import Result, ResultStatus
from tether.server.http import request_guard as guard


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path).start()
    yield running
    await running.stop()


INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


async def post(server: GatewayServer, headers: dict[str, str], query: str = "") -> httpx2.Response:
    async with httpx2.AsyncClient(timeout=WAIT) as http:
        return await http.post(server.mcp_url + query, json=INIT, headers={**MCP_HEADERS, **headers})


async def test_refused_without_a_valid_api_token(server: GatewayServer) -> None:
    missing = await post(server, {})
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer resource_metadata=")
    assert "Authorization: Bearer" in missing.json()["error"]
    wrong = await post(server, {"Authorization": "Bearer not-a-token"})
    assert wrong.status_code == 401 and wrong.json() == {"error": "unknown or revoked token"}
    device_token = server.store.tokens.create("device", "laptop")[1]
    device = await post(server, {"Authorization": f"Bearer {device_token}"})
    assert device.status_code == 403 and "device token" in device.json()["error"]
    bad_filter = await post(server, {"Authorization": f"Bearer {server.token('r', 'read')}"}, "?devices=a;rm")
    assert bad_filter.status_code == 400 and "not a device name or glob" in bad_filter.json()["error"]


async def test_a_refusal_reads_the_body_so_the_answer_is_not_lost_to_a_reset(
        server: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The body of a refused request is read before the answer: a socket closed with unread bytes sends a
    TCP reset that can overtake the 401 (a CI run lost one that way). The connection then stays usable."""
    big = {**INIT, "params": {**INIT["params"], "pad": "x" * 60_000}}  # under the 64 KiB anonymous cap
    async with httpx2.AsyncClient(timeout=WAIT, limits=httpx2.Limits(max_connections=1)) as http:
        for _ in range(5):
            refused = await http.post(server.mcp_url, json=big, headers=MCP_HEADERS)
            assert refused.status_code == 401 and "connection" not in refused.headers, refused.headers
            assert "Authorization: Bearer" in refused.json()["error"]
        assert (await http.get(f"{server.base}/api/v1/health")).status_code == 200
    # a client that stops mid-body is not waited on forever: the gateway answers once the drain times out
    monkeypatch.setattr(guard.answers, "DRAIN_TIMEOUT", 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"jsonrpc\"")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 401") and b"connection: close" in head.lower(), head
    finally:
        writer.close()


async def test_a_foreign_origin_is_refused_by_the_request_guard(server: GatewayServer) -> None:
    token = server.token("web", "read")
    refused = await post(server, {"Authorization": f"Bearer {token}", "Origin": "https://evil.example"})
    assert refused.status_code == 403 and "cross-site" in refused.json()["error"]
    ok = await post(server, {"Authorization": f"Bearer {token}", "Origin": f"http://127.0.0.1:{server.port}"})
    assert ok.status_code == 200, ok.text


async def test_fleet_and_device_tools_are_listed_with_schemas_and_annotations(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")
    async with mcp_client(server.mcp_url, server.token("reader", "read")) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert {"list_devices", "laptop__shell.run", "laptop__files.read"} <= set(listed)
        assert not any(name.endswith("list_tools") for name in listed), "meta tools are not listed"
        run = listed["laptop__shell.run"]
        assert run.input_schema["required"] == ["cmd"] and run.output_schema is not None
        assert run.annotations is not None and run.annotations.read_only_hint is False
        assert run.annotations.destructive_hint is True
        read = listed["laptop__files.read"]
        assert read.annotations is not None and read.annotations.read_only_hint is True
        assert read.annotations.destructive_hint is False

        devices = await client.call_tool("list_devices", {})
        assert not devices.is_error and devices.structured_content is not None
        [row] = devices.structured_content["devices"]
        assert row == {"name": "laptop", "status": "online", "platform": row["platform"], "tags": ["lab"],
                       "tools": 2, "sandbox": "bubblewrap", "running": 0, "queued": 0}
        bad = await client.call_tool("list_devices", {"colour": "red"})
        assert bad.is_error and "unknown argument" in bad.content[0].text

        refused = await client.call_tool("laptop__shell.run", {"cmd": "true"})
        assert refused.is_error and "lacks the 'execute' scope" in refused.content[0].text
    await laptop.close()


async def test_a_call_runs_through_the_dispatcher_and_is_audited_with_the_client(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")
    answered = laptop.serve_forever(lambda c: Result(status=ResultStatus.SUCCESS, call_id=c.call_id,
                                                     result={"exitCode": 0, "stdout": f"ran {c.tool_name}"}))
    async with mcp_client(server.mcp_url, server.token("agent", "execute")) as client:
        result = await client.call_tool("laptop__shell.run", {"cmd": "true"})
        assert not result.is_error, result
        assert result.structured_content == {"exitCode": 0, "stdout": "ran shell.run"}
        assert json.loads(result.content[0].text) == result.structured_content
        unknown = await client.call_tool("laptop__nope", {})
        assert unknown.is_error and "no tool named" in unknown.content[0].text
    answered.cancel()
    [row] = server.store.audit.rows(token="agent")
    assert row["device"] == "laptop" and row["tool_name"] == "shell.run" and row["status"] == "success"
    assert row["requested_by"] == "mcp:mcp/0.1.0 by api:agent"
    await laptop.close()


async def test_device_tool_failures_are_tool_errors(server: GatewayServer) -> None:
    laptop = await register(server, "laptop")
    answered = laptop.serve_forever(lambda c: Result.failure("exit code 2: no such file", c.call_id, "shell",
                                                             {"exitCode": 2}))
    async with mcp_client(server.mcp_url, server.token("agent", "execute")) as client:
        result = await client.call_tool("laptop__shell.run", {"cmd": "ls"})
        assert result.is_error and result.content[0].text == "exit code 2: no such file"
    answered.cancel()
    await laptop.close()


async def test_the_device_filter_lists_only_chosen_devices(server: GatewayServer) -> None:
    devices = [await register(server, name) for name in ("laptop", "lab-1", "lab-2", "desk")]
    token = server.token("reader", "read")

    async def names(query: str) -> set[str]:
        async with mcp_client(server.mcp_url + query, token) as client:
            return {t.name.split("__")[0] for t in (await client.list_tools()).tools if "__" in t.name}

    assert await names("") == {"laptop", "lab-1", "lab-2", "desk"}
    assert await names("?devices=laptop,lab-*") == {"laptop", "lab-1", "lab-2"}
    assert await names("?devices=none") == set()
    async with mcp_client(server.mcp_url + "?devices=none", token) as client:
        assert [t.name for t in (await client.list_tools()).tools] == ["list_devices", "run_on_fleet"]
    for device in devices:
        await device.close()


async def test_clients_are_told_when_a_device_connects_and_leaves(server: GatewayServer) -> None:
    token = server.token("reader", "read")
    seen, filtered = Seen(), Seen()
    async with mcp_client(server.mcp_url, token, message_handler=seen) as client, \
            mcp_client(server.mcp_url + "?devices=desk", token, message_handler=filtered) as other:
        assert not any("__" in t.name for t in (await client.list_tools()).tools)
        await other.list_tools()
        laptop = await register(server, "laptop")
        await asyncio.wait_for(seen.list_changed.wait(), WAIT)
        assert "laptop__shell.run" in {t.name for t in (await client.list_tools()).tools}
        seen.list_changed.clear()
        await laptop.close()
        await asyncio.wait_for(seen.list_changed.wait(), WAIT)
        assert not any("__" in t.name for t in (await client.list_tools()).tools)
        desk = await register(server, "desk", profile())
        await asyncio.wait_for(filtered.list_changed.wait(), WAIT)
        await desk.close()


async def test_a_client_of_the_2026_protocol_lists_and_calls_too(server: GatewayServer) -> None:
    from mcp.client.client import Client
    from mcp.client.streamable_http import streamable_http_client

    laptop = await register(server, "laptop")
    answered = laptop.serve_forever()
    headers = {"Authorization": f"Bearer {server.token('agent', 'execute')}"}
    async with httpx2.AsyncClient(headers=headers, timeout=WAIT * 6) as http, \
            Client(streamable_http_client(server.mcp_url, http_client=http)) as client:
        assert client.session.protocol_version not in ("2025-11-25", "2025-06-18"), "negotiated the 2026 era"
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"list_devices", "laptop__files.read"} <= names
        result = await client.call_tool("laptop__files.read", {"path": "/etc/hostname"})
        assert not result.is_error and result.structured_content == {"tool": "files.read",
                                                                     "args": {"path": "/etc/hostname"}}
        async with client.listen(tools_list_changed=True) as changes:  # the 2026 way to hear of changes
            desk = await register(server, "desk")
            event = await asyncio.wait_for(changes.__anext__(), WAIT)
            assert type(event).__name__ == "ToolsListChanged"
            assert "desk__shell.run" in {t.name for t in (await client.list_tools()).tools}
    answered.cancel()
    await laptop.close()
    await desk.close()


async def test_a_2026_client_approves_through_the_input_required_retry(server: GatewayServer) -> None:
    import mcp_types as types
    from mcp.client.client import Client
    from mcp.client.streamable_http import streamable_http_client

    laptop = await register(server, "laptop")

    def held_until_approved(c: Any) -> Result:
        if c.approved_by:
            return Result(status=ResultStatus.SUCCESS, call_id=c.call_id, result={"exitCode": 0, "by": c.approved_by})
        return Result.failure("needs approval (policy rule 'ask.on-miss'): `nproc`", c.call_id, "shell",
                              {"needs_approval": True, "rule": "ask.on-miss"})

    answered = laptop.serve_forever(held_until_approved)
    asked: list[str] = []

    async def elicitation(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"decision": "approve once"})

    headers = {"Authorization": f"Bearer {server.token('person', 'execute', 'approve')}"}
    async with httpx2.AsyncClient(headers=headers, timeout=WAIT * 6) as http, \
            Client(streamable_http_client(server.mcp_url, http_client=http), elicitation_callback=elicitation,
                   client_info=types.Implementation(name="sdk", version="26")) as client:
        result = await client.call_tool("laptop__shell.run", {"cmd": "nproc"})
        assert not result.is_error, result.content
        assert result.structured_content == {"exitCode": 0, "by": "mcp:sdk/26 by api:person"}
        assert asked == ["Device laptop: needs approval (policy rule 'ask.on-miss'): `nproc`"]
        forged = await client.session.call_tool(
            "laptop__shell.run", {"cmd": "nproc"}, request_state="made-up", allow_input_required=True,
            input_responses={"approval": types.ElicitResult(action="accept", content={"decision": "approve once"})})
        assert isinstance(forged, types.CallToolResult) and forged.is_error
        assert "belongs to no question" in forged.content[0].text
    answered.cancel()
    await laptop.close()
