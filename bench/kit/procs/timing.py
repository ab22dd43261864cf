"""Timing whole processes for the start-up benches: wall and CPU of a run to its exit, of `tether device`
to its "registered as" line, and the interleaved rotation every row is measured in.

CPU is user + system: of a reaped child from `getrusage(RUSAGE_CHILDREN)` taken around it (one child at a
time), of a live process from /proc/PID/stat (its own plus its reaped children's, clock-tick resolution).
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TypeVar

from bench.fleet_startup import TETHER, WAIT, _Server, _stop, _until_line

Sample = tuple[float, float]  # (wall s, cpu s)
T = TypeVar("T")

_TICK = os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU seconds of every reaped child of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def proc_cpu(pid: int) -> float:
    """CPU seconds of a live process so far: its own plus its reaped children's (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / _TICK  # utime stime cutime cstime


async def run_timed(argv: list[str], env: dict[str, str]) -> Sample:
    """Wall and CPU seconds of one process run to its exit (no other child may end meanwhile). A run that
    exits non-zero raises RuntimeError with the tail of its stderr; one past `WAIT` s, TimeoutError."""
    before = children_cpu()
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), WAIT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[1:]} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return wall, children_cpu() - before


async def device_registered(server: _Server, env: dict[str, str]) -> Sample:
    """Wall and CPU seconds of `tether device` (with `env` and the server's device token) from spawn to its
    "registered as" line against `server`; then it is stopped and reaped. TimeoutError past `WAIT` s."""
    env = {**env, "TETHER_DEVICE_TOKEN": server.secret}
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *TETHER, "device", "--server", f"ws://127.0.0.1:{server.port}", "--name", "bench",
        "--state-dir", str(server.tmp / "device"), env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        await asyncio.wait_for(_until_line(proc, b"registered as"), WAIT)
        wall = time.perf_counter() - start
        cpu = proc_cpu(proc.pid)
    finally:
        await _stop(proc)
    return wall, cpu


async def interleaved(rows: Mapping[str, Callable[[], Awaitable[T]]], repeats: int) -> dict[str, list[T]]:
    """Every row's `repeats` samples: one warm-up run of each first (not kept), then each repetition runs
    every row once, in an order rotated per repetition."""
    for run in rows.values():
        await run()
    samples: dict[str, list[T]] = {name: [] for name in rows}
    names = list(rows)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            samples[name].append(await rows[name]())
    return samples


async def echo(ws: object) -> None:
    """A websockets server handler that sends every message back (the device rows' anchor talks to it)."""
    async for message in ws:  # type: ignore[attr-defined]
        await ws.send(message)  # type: ignore[attr-defined]
