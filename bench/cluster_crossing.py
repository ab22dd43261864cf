"""One command crossing nodes, taken apart: its round trip against the same command asked of the holding
node, and the CPU it costs each process (the node asked, the holding node, the device, redis-server).

    python -m bench.cluster_crossing [--base SRC] [--devices 2] [--rounds 6] [--trips 150]

Everything is real: per tree, a private redis-server, two `tether server --cluster` nodes with direct links
on (the default), and `--devices` devices (tether's own `DeviceConnection`s in one process of this tree,
given only node 1's URL, so node 1 holds them). One caller speaking raw HTTP/1.1 on one keep-alive
connection per node sends one cheap command at a time (`list_tools` of a namespace no tool has) to node 1
(**same**: the node asked holds the device) or to node 2 (**cross**: node 2 sends it over the link to node 1
and answers with what comes back). With `--base SRC` (another checkout's `src`, e.g. `git archive main src |
tar -x -C /tmp/b`) the same set-up runs that tree's nodes too (the devices stay this tree's), and each round
measures every tree and path in turn, the order rotating per round.

Per round and path: the round trips' p50, and each process's CPU (its threads' scheduled time, to the
nanosecond) over the commands answered. Printed: medians over the rounds and their spread, the ratios
cross/same (goal: round trip <= 1.3x) and, with a base, this tree/base; the load average is printed
with the figures, since a shared machine moves wall times far more than CPU per command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench._stats import spread
from bench.cluster_scale import read_response
from bench.fleet_hotpath import request_bytes
from bench.kit.procs.cluster import Setup, admin_token, redis_server
from bench.kit.procs.cpu import cpu_exact_s
from bench.kit.procs.fleet import raise_fd_limit, tree

ROLES = ("entry", "holder", "device", "redis")  # whose CPU a command costs; on "same" the entry is the holder


@dataclass
class Side:
    """One tree's cluster: its nodes' ports, the processes by role, and the figures per path."""

    label: str
    ports: tuple[int, int] = (0, 0)  # node 1 (holds the devices), node 2
    requests: list[bytes] = field(default_factory=list)
    procs: dict[str, psutil.Process] = field(default_factory=dict)  # node1, node2, device, redis
    conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=dict)
    p50: dict[str, list[float]] = field(default_factory=dict)  # path -> p50 per round, s
    cpu: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # path -> role -> CPU s per command

    def roles(self, path: str) -> dict[str, psutil.Process]:
        entry, holder = ("node1", "node1") if path == "same" else ("node2", "node1")
        return {"entry": self.procs[entry], "holder": self.procs[holder], "device": self.procs["device"],
                "redis": self.procs["redis"]}

    async def _exchange(self, port: int, request: bytes) -> tuple[int, bytes]:
        """One request on the keep-alive connection to `port`; one the node closed while idle (between
        rounds) is opened again once."""
        for attempt in (0, 1):
            if port not in self.conns:
                self.conns[port] = await asyncio.open_connection("127.0.0.1", port)
            reader, writer = self.conns[port]
            writer.write(request)
            try:
                status, _, body = await read_response(reader)
                return status, body
            except (asyncio.IncompleteReadError, ConnectionResetError):
                del self.conns[port]
                writer.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def trips(self, path: str, n: int) -> None:
        port = self.ports[0] if path == "same" else self.ports[1]
        roles = self.roles(path)
        await self._exchange(port, self.requests[0])  # the connection open (again) before the clock starts
        before = {role: cpu_exact_s(proc) for role, proc in roles.items()}
        samples = []
        for i in range(n):
            t0 = time.perf_counter()
            status, body = await self._exchange(port, self.requests[i % len(self.requests)])
            samples.append(time.perf_counter() - t0)
            if status != 200 or b'"success"' not in body:
                raise RuntimeError(f"{self.label} {path}: a command failed: {status} {body[:300]!r}")
        after = {role: cpu_exact_s(proc) for role, proc in roles.items()}
        self.p50.setdefault(path, []).append(statistics.median(samples))
        per = self.cpu.setdefault(path, {})
        for role in ROLES:
            if path == "same" and role == "holder":
                continue  # the entry is the holder: counted once
            per.setdefault(role, []).append((after[role] - before[role]) / n)


def _redis_proc(port: int) -> psutil.Process:
    for proc in psutil.Process(os.getpid()).children():
        with contextlib.suppress(psutil.Error):
            if proc.name().startswith("redis-server") and str(port) in " ".join(proc.cmdline()):
                return proc
    raise RuntimeError(f"no redis-server on port {port} among this process's children")


async def start_side(stack: contextlib.AsyncExitStack, where: Path, label: str, src: Path | None,
                     devices: int) -> Side:
    where.mkdir()
    port = await stack.enter_async_context(redis_server(where))
    setup = Setup(where, str(where / "server.db"), port)
    stack.push_async_callback(setup.aclose)
    setup.token = await admin_token(where, setup.db)
    with tree(src):
        first = await setup.start_node(f"{label[0]}1")
        second = await setup.start_node(f"{label[0]}2")
    names = [f"{label}-{i}" for i in range(devices)]
    await setup.start_devices(names, spread_over=[first])  # this tree's devices, held by node 1
    side = Side(label, (first.port, second.port))
    side.requests = [request_bytes(f"/api/v1/devices/{name}/commands", setup.token) for name in names]
    for key, child in (("node1", first.child), ("node2", second.child), ("device", setup.peers[0])):
        assert child.proc is not None
        side.procs[key] = psutil.Process(child.proc.pid)
    side.procs["redis"] = _redis_proc(port)
    return side


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.3f} ms ({spread([v * 1e3 for v in values])})"


def report(sides: list[Side]) -> None:
    print(f"-- {os.cpu_count()} cores, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for side in sides:
        same, cross = side.p50["same"], side.p50["cross"]
        ratios = [c / s for c, s in zip(cross, same, strict=True)]
        print(f"{side.label}: round trip p50 cross {_ms(cross)}, same {_ms(same)}: cross/same "
              f"{statistics.median(ratios):.2f}x ({spread(ratios)}) goal <= 1.3x")
        for path in ("same", "cross"):
            per = side.cpu[path]
            total = [sum(v) for v in zip(*per.values(), strict=True)]
            shown = ", ".join(f"{role} {_ms(values)}" for role, values in per.items())
            print(f"   CPU per command, {path:<5}: {shown}; all {_ms(total)}")
        same_cpu, cross_cpu = side.cpu["same"], side.cpu["cross"]
        nodes_cross = [e + h for e, h in zip(cross_cpu["entry"], cross_cpu["holder"], strict=True)]
        node_same = statistics.median(same_cpu["entry"])
        print(f"   nodes' CPU cross/same: {statistics.median(nodes_cross) / node_same:.2f}x; "
              f"the holder's on a crossing / the node's on same: "
              f"{statistics.median(cross_cpu['holder']) / statistics.median(same_cpu['entry']):.2f}x; "
              f"the entry's: {statistics.median(cross_cpu['entry']) / statistics.median(same_cpu['entry']):.2f}x")
    if len(sides) == 2:
        this, base = sides
        for path in ("same", "cross"):
            rt = [a / b for a, b in zip(this.p50[path], base.p50[path], strict=True)]
            nodes = [(a1 + a2) / (b1 + b2) for a1, a2, b1, b2 in zip(
                this.cpu[path]["entry"], this.cpu[path].get("holder", [0.0] * len(rt)),
                base.cpu[path]["entry"], base.cpu[path].get("holder", [0.0] * len(rt)), strict=True)]
            print(f"this tree / base, {path:<5}: round trip p50 {statistics.median(rt):.2f}x ({spread(rt)}); "
                  f"nodes' CPU per command {statistics.median(nodes):.2f}x ({spread(nodes)})")


async def measure(base: Path | None, devices: int, rounds: int, trips: int) -> list[Side]:
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="tether-crossing-") as name:
        async with contextlib.AsyncExitStack() as stack:
            sides = [await start_side(stack, Path(name) / "this", "this", None, devices)]
            if base is not None:
                sides.append(await start_side(stack, Path(name) / "base", "base", base.resolve(), devices))
            runs = [(side, path) for side in sides for path in ("same", "cross")]
            for side, path in runs:  # warm-up: connections opened, links dialled (the first crossing dials)
                for _ in range(5):
                    await side.trips(path, 20)
                side.p50.clear()
                side.cpu.clear()
            for r in range(rounds):
                for side, path in runs[r % len(runs):] + runs[:r % len(runs)]:
                    await side.trips(path, trips)
            for side in sides:
                for _, writer in side.conns.values():
                    writer.close()
            report(sides)
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, metavar="SRC", help="another checkout's src, measured alongside")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--trips", type=int, default=150, help="sequential round trips per round and path")
    args = parser.parse_args()
    if args.devices < 1 or args.rounds < 1 or args.trips < 1:
        sys.exit("--devices, --rounds and --trips must be at least 1")
    if args.base is not None and not (args.base / "tether").is_dir():
        sys.exit("--base must be a src holding tether/")
    asyncio.run(measure(args.base, args.devices, args.rounds, args.trips))


if __name__ == "__main__":
    main()
