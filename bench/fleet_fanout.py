"""Fan-out: one cheap command to every one of N devices, time to the last device's result.

    python -m bench.fleet_fanout [--devices N] [--repeats R] [--per-process K] [--concurrency C]

A real `tether server` process (SQLite in a temp directory) and N real devices: tether's own
`DeviceConnection` in front of devices built by `build_device`, K per client process, each registered
with its own device token (bench/load.py's device processes). The command is `list_tools` restricted
to a namespace no tool has: the cheapest call every device answers, so the figure is the fan-out's own
cost (server, sockets, devices' loops), not a tool's.

Subject: `POST /api/v1/fleet/commands` (NDJSON, max_concurrency C, default the cap 1024), from the
request to the summary line, every device `ok`. Anchor, in the same run and interleaved with it: the
same N commands as N `POST /api/v1/devices/{name}/commands`, 64 concurrent REST callers on keep-alive
connections — what a script did before fan-out existed. Each figure is the median of R runs, with the
spread (min..max) beside it. Goal (issue 13): 10,000 devices in <= 2 s p50.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench._stats import fleet_row, spread
from bench.kit.procs.fleet import (
    CHEAP,
    DEVICE_NICE,
    device_name,
    free_port,
    raise_fd_limit,
    server_process,
    start_fleet,
)

ANCHOR_CALLERS = 64


async def fan_out_once(http: httpx.AsyncClient, n: int, concurrency: int) -> float:
    """One fan-out to the whole fleet; seconds from the request to the summary (every device ok)."""
    body = {"commands": [CHEAP], "timeout": 300, "max_concurrency": concurrency}
    t0 = time.perf_counter()
    summary = None
    not_ok: list[str] = []
    async with http.stream("POST", "/api/v1/fleet/commands", json=body,
                           headers={"Accept": "application/x-ndjson"}) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"fan-out refused: {answer.status_code} {(await answer.aread())[:300]!r}")
        async for line in answer.aiter_lines():
            if line.startswith('{"summary"'):
                summary = json.loads(line)["summary"]
            elif '"status":"ok"' not in line and len(not_ok) < 3:
                not_ok.append(line[:300])
    elapsed = time.perf_counter() - t0
    if summary is None or summary["ok"] != n:
        raise RuntimeError(f"fan-out to {n} devices did not end all ok: {summary}; e.g. {not_ok}")
    return elapsed


async def all_online(http: httpx.AsyncClient, n: int, within: float = 120.0) -> int:
    """How many devices /health counts online, once it is all n (or `within` seconds have passed):
    devices a loaded machine dropped and that are coming back are waited for, not measured as offline."""
    end = time.monotonic() + within
    while True:
        online = (await http.get("/api/v1/health")).json()["devices_online"]
        if online >= n or time.monotonic() > end:
            return online
        await asyncio.sleep(0.5)  # the bench's own pacing: no event crosses into the server process


async def rest_loop_once(clients: list[httpx.AsyncClient], n: int) -> float:
    """The anchor: the same n commands as n single-device REST calls, len(clients) at a time."""
    names = iter(range(n))
    body = {"commands": [CHEAP], "timeout": 60}
    errors: list[str] = []

    async def caller(http: httpx.AsyncClient) -> None:
        for i in names:
            answer = await http.post(f"/api/v1/devices/{device_name(i)}/commands", json=body)
            if answer.status_code != 200 or answer.json()["results"][0]["status"] != "success":
                errors.append(f"{device_name(i)}: {answer.status_code} {answer.text[:200]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(c) for c in clients))
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} REST calls failed, e.g. {errors[0]}")
    return elapsed


async def measure(devices: int, repeats: int = 5, per_process: int = 250,
                  concurrency: int = 1024, nice: int = DEVICE_NICE) -> list[dict[str, object]]:
    """The fan-out rows for bench/fleet.py: N devices, `repeats` interleaved runs of anchor and subject."""
    limit = raise_fd_limit()
    if limit < devices + ANCHOR_CALLERS + 200:  # the server holds one per device; each process has its own
        raise RuntimeError(f"RLIMIT_NOFILE is {limit}: too few descriptors for {devices} devices")
    with tempfile.TemporaryDirectory(prefix="tether-fanout-") as tmp_name:
        tmp = Path(tmp_name)
        from tether.server.store import Store

        store = Store(str(tmp / "server.db"))  # as `tether token create` does, before the server starts
        tokens = {device_name(i): store.tokens.create("device", device_name(i))[1] for i in range(devices)}
        api_token = store.tokens.create("api", "fanout", ["read", "execute"])[1]
        store.close()
        port = free_port()
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(server_process(tmp, port))
            t0 = time.perf_counter()
            pids = await start_fleet(stack, f"ws://127.0.0.1:{port}/aip", tmp / "devices", tokens, per_process, tmp,
                                     nice=nice)
            connect_s = time.perf_counter() - t0
            headers = {"Authorization": f"Bearer {api_token}"}
            http = await stack.enter_async_context(httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=httpx.Timeout(600, connect=30)))
            clients = [await stack.enter_async_context(httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60,
                limits=httpx.Limits(max_connections=1))) for _ in range(min(ANCHOR_CALLERS, devices))]
            online = await all_online(http, devices)
            print(f"{devices} devices registered in {connect_s:.1f} s, {online} online by /health "
                  f"({len(pids)} client processes at nice {nice}); {repeats} interleaved runs, "
                  f"max_concurrency {concurrency}")
            await fan_out_once(http, devices, concurrency)  # warm-up: connections, caches, first-call paths
            await rest_loop_once(clients, devices)
            subject: list[float] = []
            anchor: list[float] = []
            for _ in range(repeats):
                anchor.append(await rest_loop_once(clients, devices))
                subject.append(await fan_out_once(http, devices, concurrency))
    p50, base = statistics.median(subject), statistics.median(anchor)
    return [
        fleet_row(f"fan-out to {devices} devices, request -> summary p50", p50, "s",
                  f"{devices} REST POSTs, {min(ANCHOR_CALLERS, devices)} callers", base,
                  "<= 2 s at 10,000 devices", f"spread {spread(subject)} s, anchor {spread(anchor)} s"),
        fleet_row("  per device", p50 / devices * 1e3, "ms", "one REST POST in that loop", base / devices * 1e3,
                  "-", ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--per-process", type=int, default=250, help="devices per client process")
    parser.add_argument("--concurrency", type=int, default=1024, help="the fan-out's max_concurrency (1..1024)")
    parser.add_argument("--nice", type=int, default=DEVICE_NICE, choices=range(20), metavar="0..19",
                        help=f"the device processes' niceness (default {DEVICE_NICE}; see bench.kit.procs.fleet)")
    args = parser.parse_args()
    if args.devices < 1 or args.repeats < 1 or args.per_process < 1 or not 1 <= args.concurrency <= 1024:
        parser.error("--devices, --repeats, --per-process >= 1; --concurrency 1..1024")
    try:
        asyncio.run(measure(args.devices, args.repeats, args.per_process, args.concurrency, args.nice))
    except (RuntimeError, TimeoutError) as exc:
        sys.exit(f"error: {exc or 'a device process did not register its devices within 300 s'}")


if __name__ == "__main__":
    main()
