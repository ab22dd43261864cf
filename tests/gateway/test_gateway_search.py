"""Progressive listing and `find_tools` on a big fleet: 1,000 scripted devices with 13 tools each over real
AIP sockets, one in-process server, the official SDK client (2025 handshake) and raw 2026-07-28 requests."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx2

from tests.kits.gateway import READ_FILE, SHELL_RUN, GatewayServer, mcp_client, profile
from tether.protocol.models import ToolInfo

DEVICES = 1000
TOOLS = [SHELL_RUN, READ_FILE, *(ToolInfo(name=f"svc.op{k}", namespace="svc", tool_type="data_collection",
                                          description=f"Operation {k} of the service")
                                 for k in range(11))]
FLEET_TOOLS = {"list_devices", "run_on_fleet", "find_tools"}


def _2026(method: str, params: dict[str, Any], token: str) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "2026"}}}}
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream",
               "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method}
    if "name" in params:
        headers["Mcp-Name"] = params["name"]
    return body, headers


async def test_a_big_fleet_is_searched_not_listed(tmp_path: Path) -> None:
    server = await GatewayServer(tmp_path).start()
    devices = []
    try:
        started = time.monotonic()
        for first in range(0, DEVICES, 100):  # registered 100 at a time: real sockets, real registrations
            batch = [server.device(f"dev-{n:04d}", profile(*TOOLS)) for n in range(first, first + 100)]
            acks = await asyncio.gather(*(d.register() for d in batch))
            assert all(a.status.value == "ok" for a in acks)
            devices += batch
        print(f"{DEVICES} devices registered in {time.monotonic() - started:.1f} s")
        target = devices[742]
        served = target.serve_forever()
        token = server.token("ops", "read", "execute")

        async with mcp_client(server.mcp_url, token) as client:
            listed = (await client.list_tools()).tools
            assert {t.name for t in listed} == FLEET_TOOLS  # 13,000 device tools: none listed, the search is
            size = len(json.dumps([t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in listed]))
            assert size < 20_000, size
            find = next(t for t in listed if t.name == "find_tools")
            assert "tools/list lists only the fleet tools" in (find.description or "")

            found = await client.call_tool("find_tools", {"query": "read file dev-0742", "limit": 5})
            assert not found.is_error, found.content
            rows = found.structured_content["tools"]
            assert rows[0]["name"] == "dev-0742__files.read" and rows[0]["device"] == "dev-0742"
            assert rows[0]["inputSchema"] == READ_FILE.input_schema and len(rows) == 5
            assert found.structured_content["matched"] >= DEVICES  # every device's files.read matches 'read file'

            called = await client.call_tool(rows[0]["name"], {"path": "/etc/hostname"})  # not listed, callable
            assert not called.is_error, called.content
            assert server.store.audit.rows(token="ops")[0]["device"] == "dev-0742"

            narrowed = await client.call_tool("find_tools", {"query": "run", "devices": ["dev-001*"], "limit": 100})
            assert {r["device"] for r in narrowed.structured_content["tools"]} == {f"dev-001{k}" for k in range(10)}
            bad = await client.call_tool("find_tools", {"query": "run", "limit": 1000})
            assert bad.is_error and "limit" in bad.content[0].text

        async with mcp_client(server.mcp_url + "?devices=dev-01*", token) as filtered:  # the URL narrows too
            got = await filtered.call_tool("find_tools", {"query": "shell run", "limit": 100})
            assert got.structured_content["matched"] == 100
            assert all(r["device"].startswith("dev-01") for r in got.structured_content["tools"])
            outside = await filtered.call_tool("dev-0742__files.read", {"path": "/etc/hostname"})
            assert outside.is_error and "filter" in outside.content[0].text

        async with mcp_client(server.mcp_url + "?devices=dev-000*", token) as few:  # 130 tools: listed as before
            names = {t.name for t in (await few.list_tools()).tools}
            assert "find_tools" not in names and len(names - FLEET_TOOLS) == 10 * len(TOOLS)
            assert "dev-0003__svc.op7" in names

        scoped = server.store.tokens.create("api", "lab0", ["read", "execute"], devices=["dev-00*"])[1]
        async with mcp_client(server.mcp_url, scoped) as other:  # 100 devices reached, 1,300 tools: searched
            assert {t.name for t in (await other.list_tools()).tools} == FLEET_TOOLS
            seen = await other.call_tool("find_tools", {"query": "read file dev-0742"})
            rows = seen.structured_content["tools"]
            assert rows and all(r["device"].startswith("dev-00") for r in rows)
            assert seen.structured_content["matched"] == 100 * len(TOOLS)  # "dev": every tool in scope, none beyond
            refused = await other.call_tool("dev-0742__files.read", {"path": "/etc/hostname"})
            assert refused.is_error and "scope" in refused.content[0].text
        assert server.store.audit.rows(token="lab0") == []

        async with httpx2.AsyncClient(timeout=60) as http:  # the 2026-07-28 generation: the same, stateless
            body, headers = _2026("tools/list", {}, token)
            listed26 = (await http.post(server.mcp_url, json=body, headers=headers)).json()["result"]["tools"]
            assert {t["name"] for t in listed26} == FLEET_TOOLS
            body, headers = _2026("tools/call", {"name": "find_tools", "arguments": {"query": "op7 dev-0999"}}, token)
            answer = (await http.post(server.mcp_url, json=body, headers=headers)).json()["result"]
            assert answer["structuredContent"]["tools"][0]["name"] == "dev-0999__svc.op7"
        served.cancel()
    finally:
        await asyncio.gather(*(d.close() for d in devices), return_exceptions=True)
        await server.stop()
