"""The SDK's own HTTP errors at /mcp (unknown session, server full, missing session id, not acceptable) come
back as every other HTTP error of the server, `{"error": …}`, with their status and headers kept; the official
client still acts on them by their status; a 2026-era client's structured rejections stay JSON-RPC."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp.shared.exceptions import MCPError

from tests.kits.aip import WAIT
from tests.kits.gateway import GatewayServer, mcp_client

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "curl", "version": "1"}}}
LIST = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
           "MCP-Protocol-Version": "2025-11-25"}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[GatewayServer]:
    running = await GatewayServer(tmp_path).start()
    yield running
    await running.stop()


async def post(server: GatewayServer, token: str, body: Any, **headers: str) -> httpx2.Response:
    async with httpx2.AsyncClient(timeout=WAIT) as http:
        return await http.post(server.mcp_url, json=body,
                               headers={**HEADERS, "Authorization": f"Bearer {token}", **headers})


def plain(response: httpx2.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["content-length"]) == len(response.content)
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


async def test_the_sdks_refusals_have_error_bodies(server: GatewayServer) -> None:
    token = server.token("agent", "read")
    assert plain(await post(server, token, LIST, **{"Mcp-Session-Id": "0" * 32}), 404) == "Session not found"
    assert "Missing session ID" in plain(await post(server, token, LIST), 400)
    opened = await post(server, token, INIT)
    assert opened.status_code == 200, opened.text
    session = opened.headers["mcp-session-id"]
    refused = await post(server, token, LIST, **{"Mcp-Session-Id": session, "Accept": "text/html"})
    assert "Not Acceptable" in plain(refused, 406)
    assert refused.headers["mcp-session-id"] == session, "the SDK's headers are kept"
    # what is not an error passes as the SDK answers it
    listed = await post(server, token, LIST, **{"Mcp-Session-Id": session})
    assert listed.status_code == 200 and listed.json()["result"]["tools"]


async def test_a_full_server_says_so_in_an_error_body(server: GatewayServer) -> None:
    (await server.app.state.gateway.ready()).manager.max_sessions = 1
    first = await post(server, server.token("one", "read"), INIT)
    assert first.status_code == 200, first.text
    assert plain(await post(server, server.token("two", "read"), INIT), 503) == "Too many open sessions"


async def test_the_official_client_still_acts_on_the_status(server: GatewayServer) -> None:
    token = server.token("agent", "read")
    async with mcp_client(server.mcp_url, token) as client:
        assert (await client.list_tools()).tools
        manager = (await server.app.state.gateway.ready()).manager
        [(session, transport)] = list(manager._server_instances.items())
        await manager._discard_session(session, transport)  # the server ends the session (as an expiry does)
        with pytest.raises(MCPError, match="Session terminated"):
            await client.list_tools()


async def test_a_2026_clients_rejection_stays_json_rpc(server: GatewayServer) -> None:
    token = server.token("agent", "read")
    refused = await post(server, token, LIST, **{"MCP-Protocol-Version": "2099-01-01"})
    assert refused.status_code >= 400, refused.text
    body = refused.json()
    assert body.get("jsonrpc") == "2.0" and isinstance(body["error"], dict), body
