"""A persistent stdio MCP call through tether against the bare `mcp` SDK on the same server.

    python -m bench.mcp_stdio [N] [--chunk 50] [--base SRC] [--rest] [--fresh K]

Anchor: `mcp.Client` over stdio with one session, calling the tool N times. Budget (DESIGN.md):
tether's path through CommandRouter at most 1.15x the anchor's p50. Also on record: a fresh
client session per call (what the reference implementation does), which tether must not do.

Each side runs in a worker process of its own with its session open all along (`--worker SIDE`), and
the parent lets one worker at a time make `--chunk` calls, the order of the sides turning each time, so
that load that comes and goes on a shared machine falls on every side alike. A worker measures each call's
wall time and the CPU its own process spends on it (`time.process_time`; the echo server is another process
and not counted): the client-side cost that tether adds, which other load inflates far less than the wall
time. Each worker freezes its start-up objects out of the collector once warm, as `tether device` does.
`--base SRC` adds a third worker running tether from another checkout's `src` (before/after in one run).
`--rest` adds the same call over REST: a worker running a tether server and its device (in-process, over
/aip) with the echo server configured, and an HTTP client posting the command (with `--base`, twice).
The spread is the min..max over eight groups of chunks of each side's median, and of the ratio's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench._stats import pct, spread

SERVER = str(Path(__file__).with_name("echo_server.py"))
WARM = 50
GROUPS = 8
BUDGET = 1.15


def params() -> Any:
    from mcp import StdioServerParameters

    return StdioServerParameters(command=sys.executable, args=[SERVER])


async def _serve(prepare: Callable[[int], Any], call: Callable[[Any], Awaitable[None]]) -> None:
    """The worker's loop: a line with a count K runs K calls and answers their wall and CPU seconds (the
    call's arguments are prepared before its clocks start)."""
    for i in range(WARM):
        await call(prepare(i))
    gc.freeze()  # what `tether device` does once it has started (both sides alike): collections walk only what is new
    print("ready", flush=True)
    done = WARM
    for line in sys.stdin:
        if not line.strip():
            break
        walls, cpus = [], []
        for i in range(done, done + int(line)):
            request = prepare(i)
            c0, t0 = time.process_time(), time.perf_counter()
            await call(request)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        done += len(walls)
        print(json.dumps({"wall": walls, "cpu": cpus}), flush=True)


async def bare_worker() -> None:
    from mcp import Client

    async with Client(params(), read_timeout_seconds=30) as client:
        async def call(arguments: dict[str, Any]) -> None:
            result = await client.call_tool("echo", arguments)
            assert not result.is_error

        await _serve(lambda i: {"text": f"x{i}"}, call)


async def tether_worker() -> None:
    from tether.device.client import DeviceClient
    from tether.device.computer.manager import ComputerManager
    from tether.device.config import parse_device_config
    from tether.device.mcp.client.manager import MCPServerManager
    from tether.protocol.models import Command, ResultStatus
    from tether.tools.context import ToolContext
    from tether.tools.policy.model import Policy

    config = parse_device_config({"device": {"builtin": []}, "mcp": {"default": {"default": {"action": [
        {"namespace": "echo", "server_type": "stdio", "command": sys.executable, "args": [SERVER]}]}}}})
    servers = MCPServerManager()
    router = DeviceClient(servers, ComputerManager(config, servers, context=ToolContext(policy=Policy()))
                          ).command_router
    try:
        async def call(request: tuple[list[Command], float]) -> None:
            commands, deadline = request
            [result] = await router.execute(None, None, None, commands, deadline=deadline)
            assert result.status is ResultStatus.SUCCESS, result.error

        loop = asyncio.get_running_loop()
        # what the device has when a COMMAND frame reaches its router: the decoded Command and the batch's
        # deadline (the server gives every batch a timeout, 60 s unless the caller names one)
        await _serve(lambda i: ([Command(tool_name="echo", parameters={"text": f"x{i}"})], loop.time() + 60), call)
    finally:
        await servers.aclose()


async def rest_worker() -> None:
    """The same call over REST: `POST /api/v1/devices/bench/commands` to a tether server, its device (connected
    over /aip) running the echo server's tool; server, device and HTTP client all in this worker process."""
    import tempfile

    import httpx

    from bench.roundtrip import start_server, stop_server
    from tether.device.client import DeviceClient
    from tether.device.computer.manager import ComputerManager
    from tether.device.config import parse_device_config
    from tether.device.link.connection import DeviceConnection
    from tether.device.mcp.client.manager import MCPServerManager
    from tether.server.main import build_config
    from tether.server.settings import ServerSettings
    from tether.server.store import Store
    from tether.tools.context import ToolContext
    from tether.tools.policy.model import Policy

    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        settings = ServerSettings(db_path=Path(tmp) / "server.db", port=0)
        store = Store(settings.db_path)
        device_token = store.tokens.create("device", "bench")[1]
        api_token = store.tokens.create("api", "bench-api", ["execute"])[1]
        store.close()
        server, task, port = await start_server(build_config(settings, log_level="warning"))
        config = parse_device_config({"device": {"name": "bench", "builtin": []}, "mcp": {"default": {"default": {
            "action": [{"namespace": "echo", "server_type": "stdio", "command": sys.executable, "args": [SERVER]}]}}}})
        servers = MCPServerManager()
        client = DeviceClient(servers, ComputerManager(config, servers, context=ToolContext(policy=Policy())),
                              client_id="bench")
        link = DeviceConnection(client, f"ws://127.0.0.1:{port}/aip", device_token, name="bench")
        running = asyncio.create_task(link.run())
        try:
            await asyncio.wait_for(link.connected.wait(), 20)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30,
                                         headers={"Authorization": f"Bearer {api_token}"}) as http:
                async def call(body: dict[str, Any]) -> None:
                    response = await http.post("/api/v1/devices/bench/commands", json=body)
                    assert response.status_code == 200 and response.json()["results"][0]["status"] == "success", \
                        response.text

                await _serve(lambda i: {"commands": [{"tool_name": "echo", "parameters": {"text": f"x{i}"}}],
                                        "timeout": 60}, call)
        finally:
            link.stop()
            await asyncio.wait_for(running, 10)
            await servers.aclose()
            await stop_server(server, task)


class Worker:
    """One side's worker process, driven over its stdin and stdout."""

    def __init__(self, side: str, base: Path | None = None) -> None:
        env = dict(os.environ)
        if base is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(base), *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.mcp_stdio", "--worker", side], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).parent.parent)
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.chunks: list[tuple[list[float], list[float]]] = []

    def ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"worker did not start: {line!r}")

    def run(self, k: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{k}\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        self.wall += got["wall"]
        self.cpu += got["cpu"]
        self.chunks.append((got["wall"], got["cpu"]))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(10)

    def group_medians(self, what: int) -> list[float]:
        """The median of each of GROUPS groups of consecutive chunks (0: wall, 1: CPU)."""
        size = max(1, len(self.chunks) // GROUPS)
        groups = [self.chunks[i:i + size] for i in range(0, len(self.chunks) - size + 1, size)]
        return [statistics.median([s for chunk in g for s in chunk[what]]) for g in groups]


async def fresh_session_per_call(n: int) -> list[float]:
    from mcp import Client

    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        async with Client(params(), read_timeout_seconds=30) as client:
            await client.call_tool("echo", {"text": f"x{i}"})
        samples.append(time.perf_counter() - t0)
    return samples


def measure(n: int, chunk: int, base: Path | None, rest: bool = False) -> dict[str, Worker]:
    sides = {"bare": Worker("bare"), "tether": Worker("tether")}
    if base is not None:
        sides["base"] = Worker("tether", base)
    if rest:
        sides["rest"] = Worker("rest")
        if base is not None:
            sides["rest base"] = Worker("rest", base)
    try:
        for worker in sides.values():
            worker.ready()
        names = list(sides)
        for j in range(max(1, n // chunk)):
            for name in names[j % len(names):] + names[:j % len(names)]:
                sides[name].run(chunk)
    finally:
        for worker in sides.values():
            worker.close()
    return sides


def _row(name: str, worker: Worker) -> None:
    us = [s * 1e6 for s in worker.wall]
    print(f"{name:<36} p50 {pct(us, 50):8.1f} us (groups {spread([m * 1e6 for m in worker.group_medians(0)])})  "
          f"p99 {pct(us, 99):8.1f} us   CPU median {statistics.median(worker.cpu) * 1e6:6.1f} us "
          f"(groups {spread([m * 1e6 for m in worker.group_medians(1)])})   n={len(us)}")


def _ratio(label: str, ours: Worker, anchor: Worker, budget: float | None = None) -> float:
    wall = pct(ours.wall, 50) / pct(anchor.wall, 50)
    cpu = statistics.median(ours.cpu) / statistics.median(anchor.cpu)
    walls = [a / b for a, b in zip(ours.group_medians(0), anchor.group_medians(0), strict=False)]
    cpus = [a / b for a, b in zip(ours.group_medians(1), anchor.group_medians(1), strict=False)]
    verdict = "" if budget is None else f"  (budget {budget}: {'within' if wall <= budget else 'OVER'})"
    print(f"{label:<24} wall p50 {wall:.3f}x (groups {spread(walls)})   CPU {cpu:.3f}x (groups {spread(cpus)})"
          f"{verdict}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mcp_stdio", description=__doc__.split("\n\n")[0])
    parser.add_argument("n", nargs="?", type=int, default=4000, help="calls per side (default 4000)")
    parser.add_argument("--chunk", type=int, default=50, help="calls a side makes before the next side's turn")
    parser.add_argument("--base", type=Path, metavar="SRC", help="another checkout's src, run as a third side")
    parser.add_argument("--fresh", type=int, default=5, help="calls with a fresh session each (0: none)")
    parser.add_argument("--rest", action="store_true", help="also the same call over REST (server and device)")
    parser.add_argument("--worker", choices=("bare", "tether", "rest"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        asyncio.run({"bare": bare_worker, "tether": tether_worker, "rest": rest_worker}[args.worker]())
        return
    print(f"stdio MCP call, tool 'echo' on bench/echo_server.py, {args.n} calls per side in turns of {args.chunk}; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    sides = measure(args.n, args.chunk, args.base, args.rest)
    _row("anchor: bare mcp SDK, one session", sides["bare"])
    _row("tether CommandRouter -> StdioServer", sides["tether"])
    if "base" in sides:
        _row(f"the same from {args.base}", sides["base"])
    if "rest" in sides:
        _row("REST -> server -> device -> StdioServer", sides["rest"])
    if "rest base" in sides:
        _row(f"REST, from {args.base}", sides["rest base"])
    _ratio("tether / bare SDK", sides["tether"], sides["bare"], BUDGET)
    if "base" in sides:
        _ratio("--base / bare SDK", sides["base"], sides["bare"], BUDGET)
        _ratio("tether / --base", sides["tether"], sides["base"])
    if "rest" in sides:  # its CPU is the server's, the device's and the HTTP client's: compare its wall
        _ratio("REST / bare SDK", sides["rest"], sides["bare"])
    if "rest base" in sides:
        _ratio("REST --base / bare SDK", sides["rest base"], sides["bare"])
        _ratio("REST / REST --base", sides["rest"], sides["rest base"])
    if args.fresh:
        fresh = [s * 1e6 for s in asyncio.run(fresh_session_per_call(args.fresh))]
        print(f"fresh client session per call (not used): p50 {pct(fresh, 50):.0f} us, "
              f"{pct(fresh, 50) / (pct(sides['tether'].wall, 50) * 1e6):.0f}x tether's p50")
    print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
