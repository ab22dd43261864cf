"""Sessions never lock a client out: at its per-token cap a token's least recently used idle session makes room
for a new one (clients that end without an HTTP DELETE, as the TypeScript SDK's `close()` does, would otherwise
hold their sessions until the idle expiry), a session serving a request is never evicted, a token is refused
(429) only while every one of its sessions serves a request, and stateless (2026-07-28) requests need no
session at all. Driven by the official `mcp` Python SDK client and the official TypeScript SDK client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

from tests.kits.aip import WAIT
from tests.kits.gateway import GatewayServer, mcp_client, register
from tether.protocol.messages import ServerMessageType
from tether.protocol.models import Result, ResultStatus
from tether.server.mcp.gateway import core as gw  # the module that reads MAX_SESSIONS_PER_TOKEN

REPO = Path(__file__).resolve().parents[2]
NODE_MODULES = REPO / ".tether-test-node" / "node_modules"
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path).start()
    yield running
    await running.stop()


async def sessions_of(server: GatewayServer, token: str) -> int:
    gateway = await server.app.state.gateway.ready()
    info = server.store.tokens.verify(token)
    assert info is not None
    return len(gateway.manager.owned_by(info.id))


async def cycle(server: GatewayServer, token: str) -> None:
    """Connect, initialize, list, and leave without a DELETE (the Python SDK's `terminate_on_close=False`)."""
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=WAIT) as http, \
            streamable_http_client(server.mcp_url, http_client=http, terminate_on_close=False) as (read, write), \
            ClientSession(read, write, read_timeout_seconds=WAIT) as client:
        await client.initialize()
        assert (await client.list_tools()).tools


async def test_seventy_connect_close_cycles_of_one_token_are_never_refused(server: GatewayServer) -> None:
    token = server.token("agent", "read")
    for _ in range(70):
        await cycle(server, token)
    assert await sessions_of(server, token) <= gw.MAX_SESSIONS_PER_TOKEN


async def test_seventy_typescript_sdk_clients_of_one_token_are_never_refused(server: GatewayServer) -> None:
    token = server.token("agent", "read")
    script = Path(__file__).parent / "node" / "cycles.cjs"
    process = await asyncio.create_subprocess_exec(
        "node", str(script), server.mcp_url, token, "70", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "NODE_PATH": str(NODE_MODULES)})
    out, err = await asyncio.wait_for(process.communicate(), 240)
    assert process.returncode == 0, err.decode()
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["ok"] == 70 and not report["failed"], report
    assert report["tools"] >= 1
    assert await sessions_of(server, token) <= gw.MAX_SESSIONS_PER_TOKEN


async def test_a_session_serving_a_call_is_never_evicted(server: GatewayServer, monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(gw, "MAX_SESSIONS_PER_TOKEN", 2)  # read when the gateway is built (its first request)
    laptop = await register(server, "laptop")
    token = server.token("agent", "read", "execute")
    async with mcp_client(server.mcp_url, token) as busy:  # the oldest session: first to go, were it idle
        call = asyncio.create_task(busy.call_tool("laptop__files.read", {"path": "/etc/hostname"}))
        first = await laptop.expect(ServerMessageType.COMMAND)
        for _ in range(5):  # each new session evicts the other, idle, one; never the busy one
            await cycle(server, token)
        assert await sessions_of(server, token) == 2
        async with mcp_client(server.mcp_url, token) as second:  # evicts the last idle one
            blocked = asyncio.create_task(second.call_tool("laptop__files.read", {"path": "/etc/passwd"}))
            then = await laptop.expect(ServerMessageType.COMMAND)
            # with both sessions serving a request, a new one is refused, with a clear error
            async with httpx2.AsyncClient(timeout=WAIT) as http:
                refused = await http.post(server.mcp_url, json=INIT,
                                          headers={**MCP_HEADERS, "Authorization": f"Bearer {token}"})
            assert refused.status_code == 429 and "serving a request" in refused.json()["error"], refused.text
            for frame in (first, then):
                await laptop.results(frame.response_id, [Result(status=ResultStatus.SUCCESS, call_id=c.call_id,
                                                                result={"ok": True}) for c in frame.actions or []])
            for job in (call, blocked):
                result = await asyncio.wait_for(job, WAIT)
                assert not result.is_error, result.content
            assert (await busy.list_tools()).tools  # the busy session is still there, and usable
    await laptop.close()


async def test_stateless_requests_need_no_session_slot(server: GatewayServer, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    from mcp.client.client import Client
    from mcp.client.streamable_http import streamable_http_client

    monkeypatch.setattr(gw, "MAX_SESSIONS_PER_TOKEN", 1)
    laptop = await register(server, "laptop")
    token = server.token("agent", "read", "execute")
    async with mcp_client(server.mcp_url, token) as busy:
        call = asyncio.create_task(busy.call_tool("laptop__files.read", {"path": "/etc/hostname"}))
        command = await laptop.expect(ServerMessageType.COMMAND)
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=WAIT) as http, \
                Client(streamable_http_client(server.mcp_url, http_client=http)) as client:
            for _ in range(3):
                assert "laptop__files.read" in {t.name for t in (await client.list_tools()).tools}
        assert await sessions_of(server, token) == 1
        await laptop.results(command.response_id, [Result(status=ResultStatus.SUCCESS, call_id=c.call_id,
                                                          result={"ok": True}) for c in command.actions or []])
        assert not (await asyncio.wait_for(call, WAIT)).is_error
    await laptop.close()
