"""Cross-node calls at 1, 2, 4 and 8 nodes (issue 33 item 2): both routings, both transports, a bare route.

    python -m bench.cluster_scale [--nodes 1,2,4,8] [--per-node 4] [--callers 16] [--seconds 2] [--rounds 3]
                                  [--round-trips 100] [--quick]

Everything is real and on this machine. For each node count N, side by side:
- **bus**: N `tether server --cluster` nodes on a private redis-server with direct links off
  (`--set cluster_link=off`: every message between nodes goes through Redis streams, as before);
- **link**: N nodes on another private redis-server with direct links on (the default);
- **bare**: N processes of a bare uvicorn + Starlette route (bench.fleet_hotpath's), the floor.
Each cluster holds `--per-node` devices per node (tether's own `DeviceConnection`s in one client process,
device i given node i mod N first). C closed-loop callers speak raw HTTP/1.1 (one keep-alive connection
per caller and node; bench.fleet_hotpath's request and parser) and post one cheap command
(`list_tools` of a namespace no tool has) to a random device, asking either the node that holds it
(**holder**) or a random node (**random**: (N-1)/N of the calls cross nodes), or — on the linked
cluster — a random node first and then the node its answer's `X-Tether-Holder` named (**hinted**, what
tether's Client does).

Rows, rounds interleaved (the order rotates each round), medians of the rounds and their spread:
- commands/s per set-up, routing and N; random/holder for each transport (goal >= 0.8x), and each
  figure's scaling against its own 1-node figure next to the bare route's;
- at N >= 2, the sequential round trip p50 of a command crossing nodes against the same command asked
  of the holding node, for each transport (goal: link <= 1.3x).
On a 2-core machine all N nodes share the 2 cores: scaling figures are the cost of crossing, not the
speed-up more cores would give; only the ratios measured in the same run mean anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench._stats import fleet_row, pct, spread
from bench.fleet_hotpath import bare_process, request_bytes
from bench.kit.procs.cluster import Setup, admin_token, redis_server
from bench.kit.procs.fleet import cpu_s, free_port, raise_fd_limit

Target = tuple[int, bytes]  # (port, the request's bytes)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response: (status, headers in lower case, body), Content-Length or chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = bytearray()
    while size := int((await reader.readline()).split(b";")[0], 16):  # chunked
        body += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return status, headers, bytes(body)


@dataclass
class Figures:
    """One node count's measurements, per set-up and routing label ("bus random", "bare", …)."""

    rates: dict[str, list[float]] = field(default_factory=dict)  # answers/s per round
    cpu: dict[str, list[float]] = field(default_factory=dict)  # CPU s of the set-up's processes per answer
    rt: dict[str, list[float]] = field(default_factory=dict)  # sequential round trips, s
    failures: int = 0


class Callers:
    """C closed-loop callers; each keeps one keep-alive connection per port it has asked."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._conns: list[dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = [{} for _ in range(count)]
        self._hints: list[dict[bytes, int]] = [{} for _ in range(count)]  # request -> the port its hint named

    async def _conn(self, caller: int, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        conns = self._conns[caller]
        if port not in conns:
            for attempt in range(600):  # a bare route process binds before it listens: refused until then
                try:
                    conns[port] = await asyncio.open_connection("127.0.0.1", port)
                    break
                except ConnectionRefusedError:
                    if attempt == 599:
                        raise
                    await asyncio.sleep(0.05)
        return conns[port]

    async def exchange(self, caller: int, port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
        """One request and its response; a keep-alive connection the server closed while idle (between
        rounds) is opened again once."""
        for attempt in (0, 1):
            reader, writer = await self._conn(caller, port)
            writer.write(request)
            try:
                return await read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionResetError):
                del self._conns[caller][port]
                writer.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def rate(self, pick: Callable[[random.Random], Target], seconds: float, *,
                   follow: bool = False) -> tuple[float, int, int]:
        """(answers/s, failures, answers) over `seconds`, each caller sending `pick(rng)`'s request next; with
        `follow`, to the node an earlier answer's `X-Tether-Holder` named for that request, as tether's
        Client does."""
        done = failed = 0
        end = time.perf_counter() + seconds

        async def caller(index: int) -> None:
            nonlocal done, failed
            rng = random.Random(index * 7919 + int(end))
            hints = self._hints[index]
            while time.perf_counter() < end:
                port, request = pick(rng)
                port = hints.get(request, port) if follow else port
                status, headers, body = await self.exchange(index, port, request)
                if follow and (hint := headers.get("x-tether-holder")):
                    hints[request] = int(hint.rsplit(":", 1)[1])
                ok = status == 200 and b'"success"' in body
                done += ok
                failed += not ok

        t0 = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(self.count)))
        return done / (time.perf_counter() - t0), failed, done

    async def round_trips(self, target: Target, n: int) -> list[float]:
        samples = []
        for _ in range(n):
            await self._conn(0, target[0])
            t0 = time.perf_counter()
            status, _, body = await self.exchange(0, *target)
            samples.append(time.perf_counter() - t0)
            if status != 200 or b'"success"' not in body:
                raise RuntimeError(f"a command failed: {status} {body[:300]!r}")
        return samples

    async def aclose(self) -> None:
        for conns in self._conns:
            for _, writer in conns.values():
                writer.close()
        self._conns = [{} for _ in range(self.count)]


def _processes(setup: Setup, redis_port: int) -> list[psutil.Process]:
    """The set-up's nodes, device processes and its redis-server: whose CPU a command costs."""
    procs = [psutil.Process(child.proc.pid) for child in [n.child for n in setup.nodes] + setup.peers
             if child.proc is not None]
    for proc in psutil.Process(os.getpid()).children():
        with contextlib.suppress(psutil.Error):
            if proc.name().startswith("redis-server") and str(redis_port) in " ".join(proc.cmdline()):
                procs.append(proc)
    return procs


def _cpu(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += cpu_s(proc)
    return total


def _routes(setup: Setup) -> tuple[list[tuple[int, bytes, int]], list[int]]:
    """[(port of its holder, its request, index of its holder)] per device, and the nodes' ports."""
    ports = [node.port for node in setup.nodes]
    by_ws = {node.ws_url: i for i, node in enumerate(setup.nodes)}
    out = []
    for name in sorted(setup.holder):
        index = by_ws[setup.holder[name]]
        out.append((ports[index], request_bytes(f"/api/v1/devices/{name}/commands", setup.token), index))
    return out, ports


async def measure_n(tmp: Path, n: int, per_node: int, callers: int, seconds: float, rounds: int,
                    n_rt: int) -> Figures:
    """The figures at `n` nodes."""
    figures = Figures()
    rates, cpus, trips = figures.rates, figures.cpu, figures.rt
    procs: dict[str, list[psutil.Process]] = {}
    setups: dict[str, Setup] = {}
    async with contextlib.AsyncExitStack() as stack:
        for kind in ("bus", "link"):
            where = tmp / f"{kind}-{n}"
            where.mkdir()
            port = await stack.enter_async_context(redis_server(where))
            setup = Setup(where, str(where / "server.db"), port,
                          node_args=["--set", "cluster_link=off"] if kind == "bus" else [])
            stack.push_async_callback(setup.aclose)
            setup.token = await admin_token(where, setup.db)
            for i in range(n):
                await setup.start_node(f"{kind[0]}{i + 1}")
            await setup.start_devices([f"{kind}-{i:04d}" for i in range(n * per_node)], spread_over=setup.nodes)
            setups[kind] = setup
            procs[f"{kind} holder"] = procs[f"{kind} random"] = _processes(setup, port)
        bare_ports = [free_port() for _ in range(n)]
        procs["bare"] = []
        for port in bare_ports:
            procs["bare"].append(await stack.enter_async_context(bare_process(port)))
        bare_request = request_bytes("/x", None)
        pool = Callers(callers)
        stack.push_async_callback(pool.aclose)

        picks: dict[str, Callable[[random.Random], Target]] = {
            "bare": lambda rng: (rng.choice(bare_ports), bare_request)}
        for kind, setup in setups.items():
            devices, ports = _routes(setup)
            picks[f"{kind} holder"] = lambda rng, d=devices: rng.choice(d)[:2]  # type: ignore[misc]
            picks[f"{kind} random"] = lambda rng, d=devices, p=ports: (rng.choice(p), rng.choice(d)[1])  # type: ignore[misc]
        picks["link hinted"] = picks["link random"]  # a random node first, then where X-Tether-Holder said
        procs["link hinted"] = procs["link random"]
        labels = list(picks)
        for label in labels:  # warm-up: every connection opened, every link dialled, every hint taken
            await pool.rate(picks[label], min(seconds, 1.0), follow=label.endswith("hinted"))
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                before = _cpu(procs[label])
                rate, failed, done = await pool.rate(picks[label], seconds, follow=label.endswith("hinted"))
                cpus.setdefault(label, []).append((_cpu(procs[label]) - before) / max(done, 1))
                rates.setdefault(label, []).append(rate)
                figures.failures += failed
        if n >= 2:
            for r in range(rounds):
                for kind in ("bus", "link") if r % 2 == 0 else ("link", "bus"):
                    devices, ports = _routes(setups[kind])
                    port, request, index = devices[0]
                    other = ports[(index + 1) % len(ports)]
                    for label, target in ((f"{kind} same", (port, request)), (f"{kind} cross", (other, request))):
                        trips.setdefault(label, []).extend(await pool.round_trips(target, n_rt))
    return figures


def report(results: dict[int, Figures], callers: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    one = results.get(1)
    base = {label: statistics.median(v) for label, v in one.rates.items()} if one else {}
    for n, figures in sorted(results.items()):
        rates = figures.rates
        med = {label: statistics.median(v) for label, v in rates.items()}
        cpus = figures.cpu
        cpu = {label: statistics.median(v) * 1e3 for label, v in cpus.items()}
        for kind in ("bus", "link"):
            rows.append(fleet_row(f"{n} node(s), {kind}: commands/s, random node", med[f"{kind} random"], "/s",
                                  "holding node", med[f"{kind} holder"], ">= 0.8x",
                                  f"rounds {spread(rates[f'{kind} random'])} vs {spread(rates[f'{kind} holder'])}"))
            # what a command costs every process of the set-up: the figure the load on a shared machine
            # moves least, and the one many cores turn into throughput
            rows.append(fleet_row(f"{n} node(s), {kind}: CPU per command, random node", cpu[f"{kind} random"], "ms",
                                  "holding node", cpu[f"{kind} holder"], "<= 1.25x",
                                  f"rounds {spread([c * 1e3 for c in cpus[f'{kind} random']])} vs "
                                  f"{spread([c * 1e3 for c in cpus[f'{kind} holder']])} ms; bare route "
                                  f"{cpu['bare']:.3f} ms"))
        rows.append(fleet_row(f"{n} node(s), link: commands/s, random node, hint followed", med["link hinted"],
                              "/s", "holding node", med["link holder"], ">= 0.8x",
                              f"rounds {spread(rates['link hinted'])}; CPU/command {cpu['link hinted']:.3f} ms"))
        if base:
            scaled = {label: med[label] / base[label] for label in med if base.get(label)}
            print(f"   {n} node(s) vs 1 node: bare route {scaled['bare']:.2f}x; holder bus "
                  f"{scaled['bus holder']:.2f}x, link {scaled['link holder']:.2f}x; random bus "
                  f"{scaled['bus random']:.2f}x, link {scaled['link random']:.2f}x, link hinted "
                  f"{scaled['link hinted']:.2f}x  (bare {med['bare']:.0f}/s, {callers} callers; "
                  f"{figures.failures} failed)", flush=True)
        trips = figures.rt
        for kind in ("bus", "link") if trips else ():
            cross, same = trips[f"{kind} cross"], trips[f"{kind} same"]
            rows.append(fleet_row(f"{n} nodes, {kind}: round trip crossing nodes, p50", pct(cross, 50) * 1e3, "ms",
                                  "asking the holding node", pct(same, 50) * 1e3, "<= 1.3x",
                                  f"p99 {pct(cross, 99) * 1e3:.2f} vs {pct(same, 99) * 1e3:.2f} ms"))
    return rows


async def measure(nodes: list[int], per_node: int = 4, callers: int = 16, seconds: float = 2.0, rounds: int = 3,
                  n_rt: int = 100) -> list[dict[str, object]]:
    raise_fd_limit()
    results: dict[int, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="tether-cluster-scale-") as name:
        for n in nodes:  # one node count at a time: the others' processes are stopped by then
            results[n] = await measure_n(Path(name), n, per_node, callers, seconds, rounds, n_rt)
            print(f"-- {n} node(s) measured", flush=True)
    return report(results, callers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,2,4,8", help="node counts, comma-separated")
    parser.add_argument("--per-node", type=int, default=4, help="devices per node")
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0, help="closed-loop seconds per round and set-up")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-trips", type=int, default=100, help="sequential round trips per round and path")
    parser.add_argument("--quick", action="store_true", help="1 and 2 nodes, short rounds")
    args = parser.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    if args.quick:
        nodes, args.seconds, args.rounds, args.round_trips = [1, 2], 1.0, 2, 30
    asyncio.run(measure(nodes, args.per_node, args.callers, args.seconds, args.rounds, args.round_trips))


if __name__ == "__main__":
    main()
