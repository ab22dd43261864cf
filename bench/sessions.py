"""Commands/s of one device serving 1, 4 and 16 concurrent sessions of short commands.

    python -m bench.sessions [N]

Each session sends its commands one after another (a session's batches run in order); the sessions
run side by side, so the device has up to `max_concurrent_sessions` (default 4) of them running and
the rest waiting in line. The command is the built-in-speed `noop` tool of bench/roundtrip.py, the
device a real `DeviceConnection` in a child process, the server the real app under uvicorn, the
commands sent through the hub's dispatcher as the REST API and the agent do.

Anchors, measured in the same run with rounds interleaved: the 1-session figure, and a raw
`websockets` echo to a child process (one connection, sequential round trips: echoes/s).
Figures: the median of ROUNDS rounds, with the spread (min-max).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from bench.roundtrip import DEVICE, anchor_round, command_frame, echo_connection, running_tether
from tether.protocol.models import Command, ResultStatus
from tether.server.aip.hub import DeviceHub

ROUNDS = 5
SESSIONS = (1, 4, 16)


async def sessions_round(hub: DeviceHub, sessions: int, total: int) -> float:
    """`total` commands spread over `sessions` concurrent sessions; commands/s over the wall time."""
    per = max(1, total // sessions)

    async def one(index: int) -> None:
        dispatcher = hub.dispatcher(DEVICE, session_id=f"bench-{sessions}-{index}", requested_by="bench")
        for _ in range(per):
            [result] = await dispatcher.execute_commands([Command(tool_name="noop")], timeout=30)
            assert result.status is ResultStatus.SUCCESS, result.error

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(sessions)))
    return per * sessions / (time.perf_counter() - t0)


async def echo_rate(ws: object, frame: str, n: int) -> float:
    samples = await anchor_round(ws, frame, n)  # type: ignore[arg-type]
    return n / sum(samples)


def line(name: str, rates: list[float], anchor: float, one: float | None) -> None:
    mid = statistics.median(rates)
    extra = f"   x{mid / one:5.2f} of 1 session" if one else ""
    print(f"{name:<34} {mid:9.0f} commands/s  (spread {min(rates):.0f}-{max(rates):.0f})   "
          f"{mid / anchor:5.3f} of echo{extra}")


async def main(n: int) -> dict[str, float]:
    frame = command_frame()
    rates: dict[str, list[float]] = {"echo": [], **{str(k): [] for k in SESSIONS}}
    async with running_tether(True) as tether, echo_connection(True) as ws:
        await echo_rate(ws, frame, max(50, n // 4))  # warm-up
        for k in SESSIONS:
            await sessions_round(tether.hub, k, max(k, n // 4))
        for _ in range(ROUNDS):
            rates["echo"].append(await echo_rate(ws, frame, n))
            for k in SESSIONS:
                rates[str(k)].append(await sessions_round(tether.hub, k, n))
    echo = statistics.median(rates["echo"])
    one = statistics.median(rates["1"])
    print(f"one device (child process), noop commands, {ROUNDS} interleaved rounds of {n} commands per row; "
          "max_concurrent_sessions 4 (the default)")
    print(f"{'anchor: raw websockets echo':<34} {echo:9.0f} round trips/s (spread "
          f"{min(rates['echo']):.0f}-{max(rates['echo']):.0f})")
    for k in SESSIONS:
        line(f"tether: {k} concurrent session(s)", rates[str(k)], echo, one if k != 1 else None)
    return {key: statistics.median(values) for key, values in rates.items()}


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and not args[0].isdigit():
        sys.exit("usage: python -m bench.sessions [N]")
    asyncio.run(main(int(args[0]) if args else 2000))
