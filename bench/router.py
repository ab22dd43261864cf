"""CommandRouter overhead for a built-in no-op tool, against calling the tool function directly.

    python -m bench.router [N]

Budget (DESIGN.md): at most 30 us of overhead over the tool's own work.
"""

from __future__ import annotations

import asyncio
import sys
import time

from bench._stats import summary
from tether.device.client import DeviceClient
from tether.device.computer.manager import ComputerManager
from tether.device.config import parse_device_config
from tether.device.mcp.client.manager import MCPServerManager
from tether.protocol.models import Command, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet, tool


@tool("noop", tool_type="action")
async def noop(value: int = 0) -> dict:
    """Do nothing, so only tether's own cost is measured."""
    return {"value": value}


async def main(n: int) -> None:
    servers = MCPServerManager(toolsets={"bench": lambda: ToolSet("bench", [noop])})
    config = parse_device_config({"device": {"builtin": []},
                                  "mcp": {"default": {"default": {"action": [{"namespace": "bench",
                                                                             "toolset": "bench"}]}}}})
    client = DeviceClient(servers, ComputerManager(config, servers, context=ToolContext(policy=Policy())))
    router = client.command_router
    await router.execute(None, None, None, [Command(tool_name="noop")])  # build the computer once

    direct, routed, with_command = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        await noop(value=i)
        direct.append(time.perf_counter() - t0)
    commands = [Command(tool_name="noop", parameters={"value": i}) for i in range(n)]
    for cmd in commands:
        t0 = time.perf_counter()
        [result] = await router.execute(None, None, None, [cmd])
        routed.append(time.perf_counter() - t0)
        assert result.status is ResultStatus.SUCCESS
    for i in range(n):
        t0 = time.perf_counter()
        await router.execute(None, None, None, [Command(tool_name="noop", parameters={"value": i})])
        with_command.append(time.perf_counter() - t0)
    await servers.aclose()

    print(f"CommandRouter overhead, built-in no-op tool, {n} calls")
    base = summary("anchor: direct await of the tool function", direct)
    row = summary("CommandRouter.execute([command])", routed)
    full = summary("  + building the Command (uuid call_id)", with_command)
    overhead50 = row["p50_us"] - base["p50_us"]
    overhead99 = row["p99_us"] - base["p99_us"]
    print(f"overhead p50 {overhead50:.1f} us, p99 {overhead99:.1f} us (budget 30 us p50): "
          f"{'within' if overhead50 <= 30 else 'OVER'} budget; ratio to anchor p50 "
          f"{row['p50_us'] / base['p50_us']:.1f}x; with Command construction p50 {full['p50_us']:.1f} us")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000))
