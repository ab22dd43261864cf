"""Command round trip server -> device -> built-in no-op tool -> server, against a raw `websockets` echo.

    python -m bench.roundtrip [N] [--device-process] [--profile]

Anchor: a `websockets` echo server and client on 127.0.0.1 (compression off), N sequential round
trips of a text frame the size of a real COMMAND frame. tether: the real server app, run by uvicorn
as `build_config` configures it, and a real `DeviceConnection` in front of a device assembled like
`build_device` with a `noop` tool set; N sequential `hub.dispatcher(...).execute_commands([noop])`.
Budget (DESIGN.md): tether's p50 at most 3x the echo's p50.

Also on record: the *transport floor* (uvicorn with the same settings serving a bare Starlette
WebSocket route, and a `websockets` client echoing at once: tether's round trip if tether's own code
cost nothing) and the same command through the REST API (httpx, one keep-alive connection).

By default everything runs in ONE process on ONE asyncio event loop (no uvloop): echo server and
client, uvicorn and the device share it, so a round trip costs the CPU work of both ends back to
back. With --device-process the far ends (the echo server, the floor's echo client and the device)
run in one child process, as a real device does. Rounds of all rows are interleaved so machine
noise hits them alike. --profile: cProfile over N tether round trips instead of the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import os
import pstats
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from bench._stats import summary
from tether.device.client import DeviceClient
from tether.device.computer.manager import ComputerManager
from tether.device.config import DeviceConfig, parse_device_config
from tether.device.link.connection import TRANSPORT_MAX_BYTES, DeviceConnection
from tether.device.local import LocalDevice, resolve_policy
from tether.device.mcp.client.manager import MCPServerManager
from tether.protocol.codec import encode
from tether.protocol.messages import ServerMessage, ServerMessageType
from tether.protocol.models import Command, ResultStatus
from tether.server.aip.hub import DeviceHub
from tether.server.main import build_config
from tether.server.settings import ServerSettings
from tether.server.store import Store
from tether.tools.context import ToolContext
from tether.tools.journal import UndoJournal
from tether.tools.runtime import ToolSet, tool
from tether.tools.toolsets.builtin import builtin_toolsets

DEVICE = "bench"
SECRET_ENV = "TETHER_DEVICE_TOKEN"  # how a child device peer gets its token (never argv)
ROUNDS = 4
BUDGET = 3.0


@tool("noop", tool_type="action")
async def noop() -> dict:
    """Do nothing, so only the round trip is measured."""
    return {}


def bench_device(state_dir: Path) -> LocalDevice:
    """`tether.device.local.build_device` line for line, with a `bench` tool set (the `noop` tool) beside
    the always-available built-in ones (build_device cannot take extra tool sets)."""
    config: DeviceConfig = parse_device_config({
        "device": {"name": DEVICE, "builtin": ["shell", "files", "system"]},
        "mcp": {"default": {"default": {"action": [{"namespace": "bench", "toolset": "bench"}]}}}})
    policy = resolve_policy(config)
    journal = UndoJournal(state_dir)
    context = ToolContext(policy=policy, journal=journal)
    servers = MCPServerManager(toolsets={**builtin_toolsets(), "bench": lambda: ToolSet("bench", [noop])})
    computers = ComputerManager(config, servers, context=context)
    client = DeviceClient(servers, computers, client_id=config.device.name or "local")
    return LocalDevice(config, policy, state_dir, journal, context, servers, computers, client)


def command_frame() -> str:
    """A COMMAND frame as the hub sends it for one no-op command: the anchor echoes this text."""
    return encode(ServerMessage(type=ServerMessageType.COMMAND, response_id="0" * 32,
                                actions=[Command(tool_name="noop")], timeout=10, early_exit=True))


# ---------------------------------------------------------------------------------------------- far ends
# Each runs until `stop` is set and calls `ready` once it is serving; in this process or in a child.

Ready = Callable[[str], None]


async def echo_back(ws: ServerConnection | ClientConnection) -> None:
    async for message in ws:
        await ws.send(message)


async def run_echo_server(stop: asyncio.Event, ready: Ready) -> None:
    """The anchor's far end; `ready` gets its port."""
    async with serve(echo_back, "127.0.0.1", 0, compression=None, max_size=None, ping_interval=None) as server:
        ready(str(next(iter(server.sockets)).getsockname()[1]))
        await stop.wait()


async def run_echo_client(stop: asyncio.Event, ready: Ready, url: str) -> None:
    """The transport floor's far end: connects as the device does and echoes every frame."""
    async with connect(url, compression=None, max_size=TRANSPORT_MAX_BYTES, ping_interval=None) as ws:
        echo = asyncio.create_task(echo_back(ws))
        ready("")
        await stop.wait()
        echo.cancel()


async def run_device(stop: asyncio.Event, ready: Ready, url: str, state_dir: str, token: str) -> None:
    device = bench_device(Path(state_dir))
    link = DeviceConnection(device.client, url, token, name=DEVICE)
    task = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.connected.wait(), 10)
        ready("")
        await stop.wait()
    finally:
        link.stop()
        await asyncio.wait_for(task, 10)
        await device.aclose()


PEERS: dict[str, Callable[..., Awaitable[None]]] = {"echo-server": run_echo_server, "echo-client": run_echo_client,
                                                    "device": run_device}


@asynccontextmanager
async def far_end(child: bool, kind: str, *args: str, secret: str | None = None) -> AsyncIterator[str]:
    """Run a far end here (a task on this loop) or in a child process (`--peer KIND ARGS`); yields
    what it passed to `ready`. A `secret` (the device token) is its last argument, and reaches a child
    in its environment (TETHER_DEVICE_TOKEN), never on its command line."""
    extra = (secret,) if secret is not None else ()
    if not child:
        stop = asyncio.Event()
        got: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(PEERS[kind](stop, got.set_result, *args, *extra))
        try:
            await asyncio.wait([got, task], timeout=20, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # raises what went wrong
            yield got.result()
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
        return
    env = {**os.environ, SECRET_ENV: secret} if secret is not None else None
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.roundtrip", "--peer", kind, *args,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line, f"the {kind} process exited before it was ready"
        yield line.decode().strip()
    finally:
        proc.stdin.close()  # the child stops at end of input
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def peer_main(kind: str, *args: str) -> None:
    """`--peer KIND ARGS`: one far end in this child process, until its stdin closes."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    eof = loop.run_in_executor(None, sys.stdin.buffer.read)
    eof.add_done_callback(lambda _: stop.set())

    def ready(value: str) -> None:
        print(value, flush=True)

    secret = os.environ.pop(SECRET_ENV, None)
    await PEERS[kind](stop, ready, *args, *((secret,) if secret is not None else ()))


# ---------------------------------------------------------------------------------------------- rows

async def anchor_round(ws: ClientConnection, frame: str, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await ws.send(frame)
        reply = await ws.recv()
        samples.append(time.perf_counter() - t0)
        assert len(reply) == len(frame)
    return samples


async def floor_round(websocket: WebSocket, frame: str, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await websocket.send_text(frame)
        reply = await websocket.receive_text()
        samples.append(time.perf_counter() - t0)
        assert len(reply) == len(frame)
    return samples


async def tether_round(hub: DeviceHub, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        commands = [Command(tool_name="noop")]  # built outside the clock, like the anchor's frame
        t0 = time.perf_counter()
        [result] = await hub.dispatcher(DEVICE).execute_commands(commands, timeout=10)
        samples.append(time.perf_counter() - t0)
        assert result.status is ResultStatus.SUCCESS, result.error
    return samples


async def rest_round(http: httpx.AsyncClient, n: int) -> list[float]:
    samples = []
    body = {"commands": [{"tool_name": "noop"}], "timeout": 10}
    for _ in range(n):
        t0 = time.perf_counter()
        response = await http.post(f"/api/v1/devices/{DEVICE}/commands", json=body)
        samples.append(time.perf_counter() - t0)
        assert response.status_code == 200, response.text
        assert response.json()["results"][0]["status"] == ResultStatus.SUCCESS.value, response.text
    return samples


# ---------------------------------------------------------------------------------------------- servers

async def start_server(config: uvicorn.Config) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    """uvicorn binding the socket itself, as `tether server` does (port 0: any free port).

    Not a socket bound here and passed in: `socket.socket(AF_INET, SOCK_STREAM)` has proto 0, so
    asyncio does not set TCP_NODELAY on the accepted connections, and h11 (headers and body written
    separately) then waits ~40 ms for the client's delayed ACK on every HTTP response."""
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(1000):  # uvicorn offers no event for "started"
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert server.started, "uvicorn did not start"
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def stop_server(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 15)


@dataclass
class Tether:
    server: uvicorn.Server
    hub: DeviceHub
    port: int
    api_token: str


@asynccontextmanager
async def running_tether(child: bool) -> AsyncIterator[Tether]:
    """The server (temp database with a device and an API token) and the registered device, until exit."""
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        settings = ServerSettings(db_path=Path(tmp) / "server.db", port=0)
        store = Store(settings.db_path)  # as `tether token create` does, before the server starts
        device_token = store.tokens.create("device", DEVICE)[1]
        api_token = store.tokens.create("api", "bench-api", ["execute"])[1]
        store.close()
        # the real server config (ws implementation, ws_max_size, no deflate, lifespan); quiet logs so
        # the REST rows print no access lines
        server, task, port = await start_server(build_config(settings, log_level="warning"))
        try:
            async with far_end(child, "device", f"ws://127.0.0.1:{port}/aip", str(Path(tmp) / "dev"),
                               secret=device_token):
                yield Tether(server, server.config.app.state.hub, port, api_token)  # type: ignore[union-attr]
        finally:
            await stop_server(server, task)


@asynccontextmanager
async def transport_floor(like: uvicorn.Config, child: bool) -> AsyncIterator[WebSocket]:
    """uvicorn with the tether server's transport settings serving a bare Starlette WebSocket route, its
    far end a client that echoes at once. Yields the server end of the socket."""
    accepted: asyncio.Future[WebSocket] = asyncio.get_running_loop().create_future()
    finished = asyncio.Event()

    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        accepted.set_result(websocket)
        await finished.wait()

    transport = {k: getattr(like, k) for k in ("ws", "http", "ws_max_size", "ws_per_message_deflate",
                                              "ws_ping_interval", "ws_ping_timeout", "h11_max_incomplete_event_size")}
    config = uvicorn.Config(Starlette(routes=[WebSocketRoute("/aip", endpoint)]), host="127.0.0.1", port=0,
                            log_level="warning", lifespan="off", **transport)
    server, task, port = await start_server(config)
    try:
        async with far_end(child, "echo-client", f"ws://127.0.0.1:{port}/aip"):
            try:
                yield await asyncio.wait_for(accepted, 10)
            finally:
                finished.set()
    finally:
        await stop_server(server, task)


@asynccontextmanager
async def echo_connection(child: bool) -> AsyncIterator[ClientConnection]:
    async with far_end(child, "echo-server") as port, \
            connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, ping_interval=None) as ws:
        yield ws


# ---------------------------------------------------------------------------------------------- main

async def main(n: int, *, child: bool = False, profile: bool = False) -> None:
    per_round = max(1, n // ROUNDS)
    warmup = max(200, n // 10)
    frame = command_frame()
    anchor: list[float] = []
    floor: list[float] = []
    ours: list[float] = []
    rest: list[float] = []
    async with running_tether(child) as tether, echo_connection(child) as ws, \
            transport_floor(tether.server.config, child) as bare, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{tether.port}",
                              headers={"Authorization": f"Bearer {tether.api_token}"}, timeout=30) as http:
        await anchor_round(ws, frame, warmup)
        await floor_round(bare, frame, warmup)
        await tether_round(tether.hub, warmup)
        await rest_round(http, max(50, warmup // 4))
        if profile:
            return await profile_tether(tether.hub, n, child)
        for _ in range(ROUNDS):
            anchor += await anchor_round(ws, frame, per_round)
            floor += await floor_round(bare, frame, per_round)
            ours += await tether_round(tether.hub, per_round)
            rest += await rest_round(http, per_round)
        config = tether.server.config
        protocols = (f"uvicorn ws={config.ws_protocol_class.__name__}, "  # type: ignore[union-attr]
                     f"http={config.http_protocol_class.__name__}")  # type: ignore[union-attr]

    where = ("far ends (echo server, floor's echo client, device) in a child process" if child else
             "one process, one asyncio event loop for both ends")
    print(f"command round trip, built-in no-op tool, {ROUNDS} interleaved rounds of {per_round} (+{warmup} "
          f"warm-up); {where}; {protocols}; COMMAND frame {len(frame)} bytes")
    base = summary("anchor: raw websockets echo round trip", anchor)
    bare = summary("transport floor: uvicorn+Starlette <-> ws echo", floor)
    row = summary("tether: dispatcher -> AIP -> device -> noop", ours)
    api = summary("REST: POST /api/v1/devices/{name}/commands", rest)
    ratio = row["p50_us"] / base["p50_us"]
    print(f"ratio tether / echo p50: {ratio:.2f}x (budget {BUDGET:g}x: {'within' if ratio <= BUDGET else 'OVER'}); "
          f"p99 ratio {row['p99_us'] / base['p99_us']:.2f}x")
    print(f"on record: transport floor / echo p50 {bare['p50_us'] / base['p50_us']:.2f}x, tether's own code "
          f"{row['p50_us'] - bare['p50_us']:.0f} us p50 above the floor; REST / echo p50 "
          f"{api['p50_us'] / base['p50_us']:.1f}x, HTTP on top of the dispatcher "
          f"{api['p50_us'] - row['p50_us']:.0f} us")


async def profile_tether(hub: DeviceHub, n: int, child: bool) -> None:
    """cProfile over N tether round trips, top functions by own time, then by cumulative time."""
    profiler = cProfile.Profile()
    profiler.enable()
    samples = await tether_round(hub, n)
    profiler.disable()
    summary(f"tether under cProfile ({'server only' if child else 'both ends'}; slower than real)", samples)
    stats = pstats.Stats(profiler).strip_dirs().sort_stats("tottime")
    stats.print_stats(40)
    stats.sort_stats("cumtime").print_stats(60)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(peer_main(*sys.argv[2:]))
        sys.exit(0)
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    unknown = flags - {"--device-process", "--profile"}
    if unknown:
        sys.exit(f"unknown option(s) {', '.join(sorted(unknown))}; usage: python -m bench.roundtrip [N] "
                 "[--device-process] [--profile]")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    asyncio.run(main(int(args[0]) if args else 4000, child="--device-process" in flags,
                     profile="--profile" in flags))
