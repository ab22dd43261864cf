"""`tools/list` through the MCP gateway with a big fleet (issue 30: "tools/list with 1,000 devices, time and
bytes"): the progressive listing (the fleet tools and `find_tools`) against the full one, and a search.

    python -m bench.gateway_listing [--devices 1000] [--rounds 7]

Two real agent servers (the whole app under uvicorn, in this process, SQLite in a temp directory): `full`
with `mcp_progressive_over=0` (every tool listed) and `progressive` with the default setting (or just below
the fleet's tool count for a fleet smaller than that). Each gets the
same `--devices` devices, 13 tools each, registered over real AIP sockets with their key proofs and kept
connected. Requests are stateless MCP 2026-07-28 POSTs (httpx, one keep-alive connection per server):

- full: `tools/list` with every page followed (`mcp_page_size` 1000), time to the last page, bytes of all
  page bodies; the anchor;
- progressive: one `tools/list` (its single page), time and bytes;
- find_tools: one search ("read file dev-0742", limit 20) on the progressive server, time and bytes.

Rounds alternate the rows (interleaved, so drift hits all alike); each figure is the median of the rounds,
with the spread (min..max) beside it and the ratio to the full listing of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from bench._stats import spread
from bench.registration_key import key_for
from bench.roundtrip import start_server, stop_server
from tether.protocol.models import ToolInfo
from tether.protocol.profile import DeviceProfile
from tether.server.main import build_config
from tether.server.settings import ServerSettings
from tether.server.store import Store

V = "2026-07-28"
TOOLS = [ToolInfo(name="shell.run", namespace="shell", tool_type="action", description="Run a program",
                  input_schema={"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}),
         ToolInfo(name="files.read", namespace="files", tool_type="data_collection", description="Read a file",
                  input_schema={"type": "object", "properties": {"path": {"type": "string"}}}),
         *(ToolInfo(name=f"svc.op{k}", namespace="svc", tool_type="data_collection",
                    description=f"Operation {k} of the service",
                    input_schema={"type": "object", "properties": {"arg": {"type": "string"}}}) for k in range(11))]


def name_of(i: int) -> str:
    return f"dev-{i:04d}"


@contextlib.asynccontextmanager
async def fleet_server(tmp: Path, devices: int, **settings: Any) -> AsyncIterator[tuple[int, str]]:
    """A server with `devices` connected devices; its port and an API token."""
    from websockets.asyncio.client import connect

    from tether.protocol.codec import decode_server_message, encode
    from tether.protocol.identity import CHALLENGE_HEADER
    from tether.protocol.messages import ClientMessage, ClientMessageType, Registration, ServerMessageType

    config = ServerSettings(db_path=tmp / "server.db", port=0, heartbeat_interval=60.0, heartbeat_timeout=3600.0,
                            max_admitting=1024, **settings)
    store = Store(config.db_path)
    tokens = {name_of(i): store.tokens.create("device", name_of(i))[1] for i in range(devices)}
    api = store.tokens.create("api", "bench", ["read", "execute"])[1]
    store.close()
    server, task, port = await start_server(build_config(config, log_level="warning"))
    profile = DeviceProfile(tools=TOOLS, tags=["lab"])
    gate = asyncio.Semaphore(64)
    async with contextlib.AsyncExitStack() as stack:
        async def one(name: str) -> None:
            async with gate:
                ws = await stack.enter_async_context(connect(
                    f"ws://127.0.0.1:{port}/aip", additional_headers={"Authorization": f"Bearer {tokens[name]}"},
                    ping_interval=None, open_timeout=60, max_size=None))
                challenge = ws.response.headers.get(CHALLENGE_HEADER)
                proof = key_for(name).register_proof(challenge, name, name) if challenge else None
                reg = Registration(name=name, instance_id=name, profile=profile, proof=proof)
                await ws.send(encode(ClientMessage(type=ClientMessageType.REGISTER, payload=reg.model_dump())))
                answer = decode_server_message(await asyncio.wait_for(ws.recv(), 60), 1 << 24)
                if answer.type is not ServerMessageType.REGISTER_ACK:
                    raise RuntimeError(f"{name}: {answer.error}")

        await asyncio.gather(*(one(name) for name in tokens))
        try:
            yield port, api
        finally:
            await stop_server(server, task)


async def rpc(http: httpx.AsyncClient, method: str, params: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """One stateless 2026-07-28 request: its result and the body's size in bytes."""
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": {
        "io.modelcontextprotocol/protocolVersion": V, "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"}}}}
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": V, "Mcp-Method": method}
    if "name" in params:
        headers["Mcp-Name"] = params["name"]
    response = await http.post("/mcp", json=body, headers=headers)
    response.raise_for_status()
    return response.json()["result"], len(response.content)


async def list_all(http: httpx.AsyncClient) -> tuple[float, int, int]:
    """Seconds, bytes and tools of a whole `tools/list` (every page)."""
    t0 = time.perf_counter()
    size = count = 0
    cursor: str | None = None
    while True:
        result, got = await rpc(http, "tools/list", {"cursor": cursor} if cursor else {})
        size, count = size + got, count + len(result["tools"])
        cursor = result.get("nextCursor")
        if cursor is None:
            return time.perf_counter() - t0, size, count


async def search(http: httpx.AsyncClient) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    result, size = await rpc(http, "tools/call", {"name": "find_tools", "arguments": {
        "query": "read file dev-0742", "limit": 20}})
    assert not result.get("isError"), result
    return time.perf_counter() - t0, size, len(result["structuredContent"]["tools"])


async def main(devices: int, rounds: int) -> dict[str, list[tuple[float, int, int]]]:
    """Measure and print the rows; returns each row's (seconds, bytes, tools) per round."""
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        (Path(tmp) / "full").mkdir()
        (Path(tmp) / "prog").mkdir()
        started = time.perf_counter()
        over = min(ServerSettings.model_fields["mcp_progressive_over"].default, devices * len(TOOLS) - 1)
        async with fleet_server(Path(tmp) / "full", devices, mcp_progressive_over=0) as (full_port, full_api), \
                fleet_server(Path(tmp) / "prog", devices, mcp_progressive_over=over) as (prog_port, prog_api), \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{full_port}", timeout=120,
                                  headers={"Authorization": f"Bearer {full_api}"}) as full, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{prog_port}", timeout=120,
                                  headers={"Authorization": f"Bearer {prog_api}"}) as prog:
            print(f"{devices} devices x {len(TOOLS)} tools on each of 2 servers (progressive past {over} tools), "
                  f"registered in {time.perf_counter() - started:.1f} s")
            await list_all(full), await list_all(prog), await search(prog)  # warm: the SDK import, the index
            rows: dict[str, list[tuple[float, int, int]]] = {"full": [], "progressive": [], "find_tools": []}
            for _ in range(rounds):
                rows["full"].append(await list_all(full))
                rows["progressive"].append(await list_all(prog))
                rows["find_tools"].append(await search(prog))
        anchor = statistics.median(t for t, _, _ in rows["full"])
        anchor_bytes = statistics.median(b for _, b, _ in rows["full"])
        print(f"{'row':<14}{'tools':>7}{'ms p50':>10}{'spread ms':>20}{'bytes':>11}{'x full time':>13}"
              f"{'x full bytes':>14}")
        for row, samples in rows.items():
            times = [t * 1000 for t, _, _ in samples]
            size = statistics.median(b for _, b, _ in samples)
            print(f"{row:<14}{samples[0][2]:>7}{statistics.median(times):>10.1f}{spread(times):>20}{size:>11.0f}"
                  f"{statistics.median(times) / 1000 / anchor:>13.4f}{size / anchor_bytes:>14.5f}")
    return rows


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.devices, args.rounds))


if __name__ == "__main__":
    cli()
