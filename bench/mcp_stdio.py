"""A persistent stdio MCP call through tether against the bare `mcp` SDK on the same server.

    python -m bench.mcp_stdio [N]

Anchor: `mcp.Client` over stdio with one session, calling the tool N times. Budget (DESIGN.md):
tether's path through CommandRouter at most 1.15x the anchor's p50. Also on record: a fresh
client session per call (what the reference implementation does), which tether must not do.

Beside the wall p50s, the CPU this process spends per call on each side (`time.process_time` around each
call; the echo server is another process and not counted): the client-side cost that tether adds, which
other load on a shared machine inflates far less than the wall time. Rounds alternate the two sides.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from mcp import Client, StdioServerParameters

from bench._stats import spread, summary
from tether.device.client import DeviceClient
from tether.device.computer_manager import ComputerManager
from tether.device.config import parse_device_config
from tether.device.mcp.client.manager import MCPServerManager
from tether.protocol.models import Command, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy

SERVER = str(Path(__file__).with_name("echo_server.py"))


def params() -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=[SERVER])


async def bare_sdk(n: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of `n` calls on one SDK session; `cpu` gets each call's CPU seconds in this process."""
    samples = []
    async with Client(params(), read_timeout_seconds=30) as client:
        await client.call_tool("echo", {"text": "warm"})
        for i in range(n):
            c0, t0 = time.process_time(), time.perf_counter()
            result = await client.call_tool("echo", {"text": f"x{i}"})
            samples.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.append(time.process_time() - c0)
            assert not result.is_error
    return samples


async def through_tether(n: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of `n` calls through CommandRouter; `cpu` gets each call's CPU seconds in this process."""
    config = parse_device_config({"device": {"builtin": []}, "mcp": {"default": {"default": {"action": [
        {"namespace": "echo", "server_type": "stdio", "command": sys.executable, "args": [SERVER]}]}}}})
    servers = MCPServerManager()
    router = DeviceClient(servers, ComputerManager(config, servers, context=ToolContext(policy=Policy()))
                          ).command_router
    samples = []
    try:
        await router.execute(None, None, None, [Command(tool_name="echo", parameters={"text": "warm"})])
        for i in range(n):
            cmd = Command(tool_name="echo", parameters={"text": f"x{i}"})
            c0, t0 = time.process_time(), time.perf_counter()
            [result] = await router.execute(None, None, None, [cmd])
            samples.append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.append(time.process_time() - c0)
            assert result.status is ResultStatus.SUCCESS, result.error
    finally:
        await servers.aclose()
    return samples


async def fresh_session_per_call(n: int) -> list[float]:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        async with Client(params(), read_timeout_seconds=30) as client:
            await client.call_tool("echo", {"text": f"x{i}"})
        samples.append(time.perf_counter() - t0)
    return samples


async def main(n: int) -> None:
    print(f"stdio MCP call, tool 'echo' on bench/echo_server.py, {n} calls (fresh sessions: {max(5, n // 100)})")
    # interleave rounds so machine noise hits both sides alike
    bare: list[float] = []
    ours: list[float] = []
    bare_cpu: list[float] = []
    ours_cpu: list[float] = []
    cpu_medians: dict[str, list[float]] = {"bare": [], "tether": []}
    rounds = 4
    for _ in range(rounds):
        for name, run, cpu in (("bare", bare_sdk, bare_cpu), ("tether", through_tether, ours_cpu)):
            round_cpu: list[float] = []
            (bare if name == "bare" else ours).extend(await run(n // rounds, round_cpu))
            cpu.extend(round_cpu)
            cpu_medians[name].append(statistics.median(round_cpu) * 1e6)
    anchor = summary("anchor: bare mcp SDK, persistent session", bare)
    row = summary("tether CommandRouter -> StdioServer", ours)
    fresh = summary("fresh client session per call (not used)", await fresh_session_per_call(max(5, n // 100)))
    cpu_ratio = statistics.median(ours_cpu) / statistics.median(bare_cpu)
    print(f"CPU per call in this process, median: bare SDK {statistics.median(bare_cpu) * 1e6:.0f} us "
          f"(round medians {spread(cpu_medians['bare'])}), tether {statistics.median(ours_cpu) * 1e6:.0f} us "
          f"(round medians {spread(cpu_medians['tether'])}): {cpu_ratio:.3f}x")
    ratio = row["p50_us"] / anchor["p50_us"]
    print(f"ratio tether / bare SDK p50: {ratio:.3f} (budget 1.15: {'within' if ratio <= 1.15 else 'OVER'}); "
          f"fresh session per call / tether p50: {fresh['p50_us'] / row['p50_us']:.0f}x slower")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
