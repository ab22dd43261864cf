"""A device tool call through the MCP gateway (`/mcp`), against the same command through REST and through
tether's own dispatcher, and against a bare `mcp` SDK streamable-HTTP server with a no-op tool.

    python -m bench.gateway [N]

Rows, all in one run with their rounds interleaved (ROUNDS rounds of N/ROUNDS sequential calls each):
- command: `hub.dispatcher(...).execute_commands([noop])`, tether's own round trip server -> device -> server
  (bench.roundtrip's device, a real `DeviceConnection` with a `noop` tool);
- REST: `POST /api/v1/devices/bench/commands` (httpx, one keep-alive connection);
- gateway: the official SDK `ClientSession.call_tool("bench__noop")` on one MCP session (2025 handshake,
  streamable HTTP), through the real server app's `/mcp` (answered with one JSON body, as a call that
  streams nothing is: server/mcp/front/transport.py);
- gateway 2025 raw: the same device call on a 2025 session (initialize once, then each call a POST with its
  `Mcp-Session-Id`), sent with the REST row's httpx client: the session path like-for-like with REST;
- gateway 2026: the same device call as a stateless MCP 2026-07-28 request (one POST with its version,
  capabilities and client in `_meta` and the `Mcp-Method`/`Mcp-Name` headers, no session), sent with the
  REST row's httpx client: the like-for-like comparison with REST (goal: at most 2x REST's p50);
- list_devices: the gateway's own fleet tool (no device involved): the HTTP, token and SDK session part;
- bare SDK: the same client against a low-level `mcp` `Server` whose only tool returns at once, served by
  the SDK's own `streamable_http_app()` under uvicorn (no tether code at all), as the SDK serves by
  default: every answer an SSE stream. The anchor of the goal;
- bare SDK JSON: the same bare server with the SDK's `json_response=True` (every answer a JSON body, so no
  progress or questions ever), to show how much of the gap the gateway's JSON answers close;
- gateway vs list_devices + command (interleaved pairs): the gateway's device call and, right after it,
  one list_devices call plus one command: in a call, the command runs with the caches the HTTP path left
  cold, so it costs more than the `command` row's tight loop, and this pair shows whether the gateway's
  device call costs more than its parts.
Goal (issue 11): what the gateway adds on top of the command round trip, gateway p50 - command p50, is at
most 1.2x the bare SDK server's round trip p50.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp_types as types
import uvicorn
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server
from mcp.server.context import ServerRequestContext

from bench._stats import pct, spread
from bench.roundtrip import DEVICE, Tether, bench_device, rest_round, start_server, stop_server, tether_round
from tether.device.link.connection import DeviceConnection
from tether.device.probe import collect_profile
from tether.server.main import build_config
from tether.server.settings import ServerSettings
from tether.server.store import Store

ROUNDS = 5
GOAL = 1.2
PAIR = "gateway - (list_devices + command)"
REST_GOAL = 2.0  # a gateway device call against the same command over REST
ROWS = ("command", "REST", "gateway", "gateway 2025 raw", "gateway 2026", "list_devices", "bare SDK", "bare SDK JSON",
        PAIR)
MODERN = "2026-07-28"
SESSION_VERSION = "2025-06-18"


@contextlib.asynccontextmanager
async def running_tether() -> AsyncIterator[Tether]:
    """bench.roundtrip's server and in-process device, the device registering with its real profile (its
    tools, which the gateway lists) as `tether device` does."""
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        settings = ServerSettings(db_path=Path(tmp) / "server.db", port=0)
        store = Store(settings.db_path)
        device_token = store.tokens.create("device", DEVICE)[1]
        api_token = store.tokens.create("api", "bench-api", ["execute"])[1]
        store.close()
        server, task, port = await start_server(build_config(settings, log_level="warning"))
        device = bench_device(Path(tmp) / "dev")
        link = DeviceConnection(device.client, f"ws://127.0.0.1:{port}/aip", device_token, name=DEVICE,
                                profile=lambda: collect_profile(device))
        running = asyncio.create_task(link.run())
        try:
            await asyncio.wait_for(link.connected.wait(), 20)
            yield Tether(server, server.config.app.state.hub, port, api_token)  # type: ignore[union-attr]
        finally:
            link.stop()
            await asyncio.wait_for(running, 10)
            await device.aclose()
            await stop_server(server, task)


@contextlib.asynccontextmanager
async def mcp_session(url: str, token: str | None = None) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0)) as http, \
            streamable_http_client(url, http_client=http) as (read, write), \
            ClientSession(read, write, read_timeout_seconds=30) as session:
        await session.initialize()
        yield session


def bare_server() -> Server[Any]:
    tool = types.Tool(name="noop", input_schema={"type": "object", "properties": {}})

    async def list_tools(ctx: ServerRequestContext[Any], params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool])

    async def call_tool(ctx: ServerRequestContext[Any], params: types.CallToolRequestParams) -> types.CallToolResult:
        return types.CallToolResult(content=[], structured_content={})

    return Server("bare", on_list_tools=list_tools, on_call_tool=call_tool)


async def mcp_round(session: ClientSession, name: str, n: int, arguments: dict[str, Any] | None = None) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = await session.call_tool(name, arguments or {})
        samples.append(time.perf_counter() - t0)
        assert not result.is_error, result.content
    return samples


async def open_session(http: httpx.AsyncClient) -> str:
    """A 2025 MCP session on the gateway opened with raw HTTP (initialize, then the initialized
    notification); its `Mcp-Session-Id`."""
    headers = {"Accept": "application/json, text/event-stream"}
    response = await http.post("/mcp", headers=headers, json={
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": SESSION_VERSION, "capabilities": {},
                   "clientInfo": {"name": "bench", "version": "1"}}})
    assert response.status_code == 200, response.text
    session = response.headers["mcp-session-id"]
    done = await http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                           headers={**headers, "Mcp-Session-Id": session, "MCP-Protocol-Version": SESSION_VERSION})
    assert done.status_code in (200, 202), done.text
    return session


async def session_round(http: httpx.AsyncClient, session: str, n: int) -> list[float]:
    """`n` `tools/call`s of the device's no-op tool on a 2025 session, raw HTTP with the REST row's client:
    the like-for-like comparison with REST for the session path (the `gateway` row adds the SDK client's
    own work, which runs in this process too)."""
    name = f"{DEVICE}__noop"
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": SESSION_VERSION,
               "Mcp-Session-Id": session}
    samples = []
    for i in range(n):
        body = {"jsonrpc": "2.0", "id": i + 1, "method": "tools/call", "params": {"name": name, "arguments": {}}}
        t0 = time.perf_counter()
        response = await http.post("/mcp", json=body, headers=headers)
        samples.append(time.perf_counter() - t0)
        assert response.status_code == 200 and response.json()["result"]["isError"] is False, response.text
    return samples


async def modern_round(http: httpx.AsyncClient, n: int) -> list[float]:
    """`n` stateless 2026-07-28 `tools/call`s of the device's no-op tool, raw HTTP as the specification
    writes them."""
    name = f"{DEVICE}__noop"
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": MODERN,
               "Mcp-Method": "tools/call", "Mcp-Name": name}
    meta = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"}}
    samples = []
    for i in range(n):
        body = {"jsonrpc": "2.0", "id": i, "method": "tools/call",
                "params": {"name": name, "arguments": {}, "_meta": meta}}
        t0 = time.perf_counter()
        response = await http.post("/mcp", json=body, headers=headers)
        samples.append(time.perf_counter() - t0)
        assert response.status_code == 200 and response.json()["result"]["isError"] is False, response.text
    return samples


async def pair_round(gateway: ClientSession, tether: Tether, n: int) -> list[float]:
    """Per sample: a gateway device call minus the list_devices call and the command that follow it (so they
    run with the caches a gateway call leaves); a p50 near 0 says the device call costs what its parts do."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await mcp_round(gateway, f"{DEVICE}__noop", 1)
        t1 = time.perf_counter()
        await mcp_round(gateway, "list_devices", 1, {"name": "nothing"})
        await tether_round(tether.hub, 1)
        samples.append((t1 - t0) - (time.perf_counter() - t1))
    return samples


async def measure(n: int, *, rounds: int = ROUNDS) -> dict[str, Any]:
    """Per row: every sample, and the p50 of each round (for the spread). Prints nothing."""
    per_round = max(1, n // rounds)
    rows: dict[str, list[float]] = {name: [] for name in ROWS}
    medians: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[float]] = {k: [] for k in rows}  # per round: this process's CPU seconds per call
    bare_uvicorn, bare_task, bare_port = await start_server(uvicorn.Config(
        bare_server().streamable_http_app(), host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    json_uvicorn, json_task, json_port = await start_server(uvicorn.Config(
        bare_server().streamable_http_app(json_response=True), host="127.0.0.1", port=0, log_level="warning",
        lifespan="on"))
    try:
        async with running_tether() as tether, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{tether.port}",
                                  headers={"Authorization": f"Bearer {tether.api_token}"}, timeout=30) as http, \
                mcp_session(f"http://127.0.0.1:{tether.port}/mcp", tether.api_token) as gateway, \
                mcp_session(f"http://127.0.0.1:{bare_port}/mcp") as sdk, \
                mcp_session(f"http://127.0.0.1:{json_port}/mcp") as sdk_json:
            listed = {t.name for t in (await gateway.list_tools()).tools}
            assert f"{DEVICE}__noop" in listed, sorted(listed)
            await sdk.list_tools()
            session = await open_session(http)
            runs = {"command": lambda k: tether_round(tether.hub, k), "REST": lambda k: rest_round(http, k),
                    "gateway": lambda k: mcp_round(gateway, f"{DEVICE}__noop", k),
                    "gateway 2025 raw": lambda k: session_round(http, session, k),
                    "gateway 2026": lambda k: modern_round(http, k),
                    "list_devices": lambda k: mcp_round(gateway, "list_devices", k, {"name": "nothing"}),
                    "bare SDK": lambda k: mcp_round(sdk, "noop", k),
                    "bare SDK JSON": lambda k: mcp_round(sdk_json, "noop", k),
                    PAIR: lambda k: pair_round(gateway, tether, k)}
            for run in runs.values():  # warm up every path once
                await run(max(2, per_round // 10))
            for _ in range(rounds):
                for name, run in runs.items():
                    c0 = time.process_time()
                    samples = await run(per_round)
                    cpu[name].append((time.process_time() - c0) / per_round)
                    rows[name] += samples
                    medians[name].append(statistics.median(samples))
    finally:
        await stop_server(json_uvicorn, json_task)
        await stop_server(bare_uvicorn, bare_task)
    return {"rows": rows, "medians": medians, "cpu": cpu, "per_round": per_round, "rounds": rounds}


def report(measured: dict[str, Any]) -> dict[str, float]:
    rows, medians, cpu = measured["rows"], measured["medians"], measured["cpu"]
    p50 = {name: pct(samples, 50) * 1e6 for name, samples in rows.items()}
    print(f"{measured['rounds']} interleaved rounds of {measured['per_round']} sequential calls per row; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name, samples in rows.items():
        us = [s * 1e6 for s in samples]
        print(f"{name:<34} p50 {p50[name]:9.1f} us   p99 {pct(us, 99):9.1f} us   "
              f"round medians {spread([m * 1e6 for m in medians[name]])} us   "
              f"CPU/call {statistics.median(cpu[name]) * 1e6:7.1f} us ({spread([c * 1e6 for c in cpu[name]])})   "
              f"n={len(us)}")
    added = p50["gateway"] - p50["command"]
    ratio = added / p50["bare SDK"]
    print(f"REST / command p50: {p50['REST'] / p50['command']:.2f}x   gateway / REST p50: "
          f"{p50['gateway'] / p50['REST']:.2f}x   list_devices / bare SDK p50: "
          f"{p50['list_devices'] / p50['bare SDK']:.2f}x")
    print(f"gateway adds {added:.1f} us over the command round trip = {ratio:.2f}x the bare SDK server's round "
          f"trip ({p50['bare SDK']:.1f} us); goal <= {GOAL}x: {'met' if ratio <= GOAL else 'NOT met'}")
    rest_ratio = p50["gateway 2026"] / p50["REST"]
    cpu_ratios = [g / r for g, r in zip(cpu["gateway 2026"], cpu["REST"], strict=True)]
    print(f"CPU per call (client, server and device are all this process), gateway 2026 / REST: "
          f"{statistics.median(cpu['gateway 2026']) / statistics.median(cpu['REST']):.2f}x "
          f"(rounds {spread(cpu_ratios)})")
    session_ratio = p50["gateway 2025 raw"] / p50["REST"]
    print(f"a device call over /mcp, stateless 2026-07-28 / the same call over REST p50: {rest_ratio:.2f}x, "
          f"on a 2025 session (raw HTTP): {session_ratio:.2f}x (through the SDK client: "
          f"{p50['gateway'] / p50['REST']:.2f}x); goal <= {REST_GOAL}x: "
          f"{'met' if max(rest_ratio, session_ratio) <= REST_GOAL else 'NOT met'}")
    json_ratio = added / p50["bare SDK JSON"]
    print(f"against the SDK's JSON mode ({p50['bare SDK JSON']:.1f} us, no progress or questions possible): "
          f"{json_ratio:.2f}x; list_devices / bare SDK JSON p50: {p50['list_devices'] / p50['bare SDK JSON']:.2f}x; "
          f"the device call costs {p50[PAIR]:+.1f} us beyond list_devices + a command run right after it")
    return {**p50, "added": added, "ratio": ratio, "json_ratio": json_ratio, "rest_ratio": rest_ratio,
            "session_ratio": session_ratio}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 1000
    report(asyncio.run(measure(n)))


if __name__ == "__main__":
    main()
