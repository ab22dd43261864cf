"""REST command throughput and p99 with PostgreSQL 0, 0.5 and 2 ms away, against the same server on SQLite.

    python -m bench.db_latency [--seconds S] [--rounds R] [--callers C] [--devices N]

Four real `tether server` processes run side by side: one on its SQLite file (the anchor) and three on
their own database of one private PostgreSQL (bench/kit/engines.py), reached through a TCP proxy that delays
every byte 0, 0.5 or 2 ms each way (bench/kit/delay_proxy.py; its own thread, in this process). Each server
has N devices (tether's own `DeviceConnection`s, one client process per server, as bench/load.py starts
them). C concurrent REST callers (httpx, one keep-alive connection each) post one cheap command per batch
(`list_tools` of a namespace no tool has) to a random device of the server under test for S seconds; the
servers take turns, R rounds, the order rotated each round so that machine noise hits them alike. Every
command writes its `sent` row and its outcome (the audit log's group commits), so a database round trip
sits on every command's path.

Printed: commands/s (median of the rounds, and the spread), p50 and p99 latency over all rounds, and the
ratios to the SQLite server and to the 0 ms PostgreSQL server of the same run. Budget (DESIGN.md):
PostgreSQL 2 ms away ≥ 0.5x the 0 ms figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench._stats import pct, spread
from bench.kit.delay_proxy import DelayProxy
from bench.kit.engines import postgres_server
from bench.kit.procs.fleet import CHEAP, device_name, device_process, free_port, server_process

DELAYS_MS = (0.0, 0.5, 2.0)


@dataclass
class Target:
    label: str
    db: str
    url: str = ""
    token: str = ""
    rates: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def make_tokens(db: str, devices: int) -> tuple[str, dict[str, str]]:
    """An execute token and one device token per device, written into the server's database beforehand."""
    from tether.server.store import Store

    store = Store(db)
    try:
        api = store.tokens.create("api", "bench", ["execute"])[1]
        return api, {device_name(i): store.tokens.create("device", device_name(i))[1] for i in range(devices)}
    finally:
        store.close()


@asynccontextmanager
async def server(tmp: Path, target: Target) -> AsyncIterator[None]:
    port = free_port()
    target.url = f"http://127.0.0.1:{port}"
    async with server_process(tmp, port, db=target.db, label=f"{target.label} server", ready_s=60):
        yield


async def stream(target: Target, callers: int, devices: int, seconds: float, seed: int) -> None:
    """C callers on `target` for `seconds`: its commands/s of this round, its latencies, its errors."""
    body = {"commands": [CHEAP], "timeout": 30}
    headers = {"Authorization": f"Bearer {target.token}"}
    clients = [httpx.AsyncClient(base_url=target.url, headers=headers, timeout=60) for _ in range(callers)]
    done = 0
    stop_at = 0.0

    async def caller(http: httpx.AsyncClient, rng: random.Random) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            name = device_name(rng.randrange(devices))
            t0 = time.perf_counter()
            try:
                answer = await http.post(f"/api/v1/devices/{name}/commands", json=body)
                ok = answer.status_code == 200 and answer.json()["results"][0]["status"] == "success"
                why = "" if ok else f"{answer.status_code} {answer.text[:200]}"
            except httpx.HTTPError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                target.latencies.append(time.perf_counter() - t0)
                done += 1
            else:
                target.errors.append(why)

    try:
        for http in clients:  # connections open before the clock starts
            await http.get("/api/v1/health")
        start = time.perf_counter()
        stop_at = start + seconds
        await asyncio.gather(*(caller(http, random.Random(seed * 1000 + i)) for i, http in enumerate(clients)))
        target.rates.append(done / (time.perf_counter() - start))
    finally:
        for http in clients:
            await http.aclose()


async def main(seconds: float, rounds: int, callers: int, devices: int) -> int:
    with tempfile.TemporaryDirectory(prefix="tether-db-latency-") as tmp, postgres_server() as pg, \
            contextlib.ExitStack() as proxies:
        import psycopg

        root = Path(tmp)
        targets = [Target("SQLite", str(root / "sqlite" / "server.db"))]
        with psycopg.connect(pg.url, autocommit=True) as admin:
            for i, delay in enumerate(DELAYS_MS):
                admin.execute(f"CREATE DATABASE bench_{i}")
                proxy = proxies.enter_context(contextlib.closing(DelayProxy(pg.port, delay / 1000).start()))
                url = f"postgresql://tether@127.0.0.1:{proxy.port}/bench_{i}"
                targets.append(Target(f"PostgreSQL +{delay:g} ms each way", url))
        async with contextlib.AsyncExitStack() as stack:
            for i, target in enumerate(targets):
                (root / f"t{i}").mkdir()
                if target.db.endswith(".db"):
                    Path(target.db).parent.mkdir(parents=True)
                target.token, tokens = make_tokens(target.db, devices)
                await stack.enter_async_context(server(root / f"t{i}", target))
                await stack.enter_async_context(device_process(target.url.replace("http", "ws") + "/aip",
                                                               root / f"t{i}" / "devices", tokens,
                                                               root / f"t{i}" / "devices.log"))
            for target in targets:  # warm-up: not kept
                await stream(target, callers, devices, 1.0, 0)
                target.rates.clear()
                target.latencies.clear()
            for r in range(rounds):
                for target in targets[r % len(targets):] + targets[:r % len(targets)]:
                    await stream(target, callers, devices, seconds, r + 1)

    sqlite, zero = targets[0], targets[1]
    print(f"REST commands, {callers} callers, {devices} devices per server, {rounds} rounds of {seconds:g} s "
          f"per server, interleaved (python {sys.version.split()[0]})")
    print(f"{'server':<32}{'commands/s':>12}{'spread':>16}{'p50 ms':>9}{'p99 ms':>9}{'x SQLite':>10}"
          f"{'x PG 0 ms':>11}{'errors':>8}")
    for target in targets:
        rate = statistics.median(target.rates)
        lat = sorted(target.latencies)
        print(f"{target.label:<32}{rate:>12.0f}{spread(target.rates):>16}{pct(lat, 50) * 1e3:>9.2f}"
              f"{pct(lat, 99) * 1e3:>9.2f}{rate / statistics.median(sqlite.rates):>10.2f}"
              f"{rate / statistics.median(zero.rates):>11.2f}{len(target.errors):>8}")
    for target in targets:
        if target.errors:
            print(f"{target.label}: first error: {target.errors[0]}")
    two = targets[-1]
    ratio = statistics.median(two.rates) / statistics.median(zero.rates)
    print(f"budget: PostgreSQL 2 ms away ≥ 0.5x the 0 ms figure: {ratio:.2f}x — {'met' if ratio >= 0.5 else 'NOT met'}")
    return 0 if not any(t.errors for t in targets) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--devices", type=int, default=10)
    args = parser.parse_args()
    sys.exit(asyncio.run(main(args.seconds, args.rounds, args.callers, args.devices)))
