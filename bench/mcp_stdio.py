"""A persistent stdio MCP call through tether against the bare `mcp` SDK on the same server.

    python -m bench.mcp_stdio [N]

Anchor: `mcp.Client` over stdio with one session, calling the tool N times. Budget (DESIGN.md):
tether's path through CommandRouter at most 1.15x the anchor's p50. Also on record: a fresh
client session per call (what the reference implementation does), which tether must not do.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from mcp import Client, StdioServerParameters

from bench._stats import summary
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


async def bare_sdk(n: int) -> list[float]:
    samples = []
    async with Client(params(), read_timeout_seconds=30) as client:
        await client.call_tool("echo", {"text": "warm"})
        for i in range(n):
            t0 = time.perf_counter()
            result = await client.call_tool("echo", {"text": f"x{i}"})
            samples.append(time.perf_counter() - t0)
            assert not result.is_error
    return samples


async def through_tether(n: int) -> list[float]:
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
            t0 = time.perf_counter()
            [result] = await router.execute(None, None, None, [cmd])
            samples.append(time.perf_counter() - t0)
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
    rounds = 4
    for _ in range(rounds):
        bare += await bare_sdk(n // rounds)
        ours += await through_tether(n // rounds)
    anchor = summary("anchor: bare mcp SDK, persistent session", bare)
    row = summary("tether CommandRouter -> StdioServer", ours)
    fresh = summary("fresh client session per call (not used)", await fresh_session_per_call(max(5, n // 100)))
    ratio = row["p50_us"] / anchor["p50_us"]
    print(f"ratio tether / bare SDK p50: {ratio:.3f} (budget 1.15: {'within' if ratio <= 1.15 else 'OVER'}); "
          f"fresh session per call / tether p50: {fresh['p50_us'] / row['p50_us']:.0f}x slower")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
