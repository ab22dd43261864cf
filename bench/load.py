"""Load: 1,000 device connections on one real server process, a steady REST command stream, and a stuck device.

    python -m bench.load [--devices N] [--seconds S] [--callers C] [--per-process K]

The server is a real `tether server` process (`python -m tether.cli server`, SQLite store in a temp
directory) and the devices are tether's own `DeviceConnection`s in front of devices assembled by
`tether.device.local.build_device`, K of them per client process (default 250), each registered with a
real device token made beforehand with the store API (as `tether token create` does); a client process
gets its tokens on stdin, never on its command line. The command stream is C concurrent REST callers
(httpx, one keep-alive connection each, an `execute` API token) posting one command per batch to a
random device: `list_tools` restricted to a namespace no tool has, the cheapest tool every device has
(a built-in meta tool: no thread, no I/O, an empty list back).

After a warm-up the stream runs S seconds (default 120) in 4 interleaved rounds: in rounds 2 and 4 one
device (`load-0000`, a sandboxed device in the first client process beside K-1 neighbours) is stuck on
`shell.run sleep 600`, cancelled with `DELETE /api/v1/batches/{id}` when its round ends. The other
devices' latencies are compared between the free and the stuck rounds (all of them, and the stuck
device's own neighbours in its client process). The server's RSS and CPU are sampled over time and
printed as a table (flat once steady); errors must be 0.

Anchor, measured in the same run: a raw `websockets` echo round trip across processes (the far end in a
child process, `bench.roundtrip`'s echo server), before the stream and after it, while the devices are
connected and idle. File descriptors: this process raises RLIMIT_NOFILE to its hard limit, and every child
(the server included) inherits it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from websockets.asyncio.client import connect

from bench._stats import pct
from bench.kit.procs.fleet import (
    CHEAP,
    STUCK,
    cpu_s,
    device_name,
    device_process,
    free_port,
    raise_fd_limit,
    server_process,
)
from bench.roundtrip import anchor_round, command_frame, far_end

ROUNDS = 4  # free, stuck, free, stuck
ECHO_N = 2000




# ---------------------------------------------------------------------------------------------- the stream

@dataclass
class Sample:
    done_at: float
    latency: float
    device: int
    round: int


@dataclass
class Stream:
    http: list[httpx.AsyncClient]
    pool: list[int]  # device indexes the stream may choose (every one but the stuck device)
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    round: int = -1  # -1: warm-up (not kept)
    stop: bool = False

    async def caller(self, http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        body = {"commands": [CHEAP], "timeout": 30}
        while not self.stop:
            index = rng.choice(self.pool)
            t0 = time.perf_counter()
            try:
                answer = await http.post(f"/api/v1/devices/{device_name(index)}/commands", json=body)
                ok = answer.status_code == 200 and answer.json()["results"][0]["status"] == "success"
                why = "" if ok else f"{answer.status_code} {answer.text[:200]}"
            except httpx.HTTPError as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            t1 = time.perf_counter()
            if not ok:
                self.errors.append(f"{device_name(index)}: {why}")
            elif self.round >= 0:
                self.samples.append(Sample(t1, t1 - t0, index, self.round))


async def stuck_command(http: httpx.AsyncClient, round_over: asyncio.Event, cwd: str) -> str:
    """`shell.run sleep 600` on the stuck device until `round_over`; then DELETE its batch. Returns what
    happened, e.g. 'cancelled after 30.1 s'."""
    body = {"commands": [{"tool_name": "shell.run", "parameters": {"cmd": "sleep", "argv": ["600"], "cwd": cwd}}],
            "timeout": 900}
    t0 = time.perf_counter()
    async with http.stream("POST", f"/api/v1/devices/{STUCK}/commands", json=body,
                           timeout=httpx.Timeout(None, connect=30)) as answer:
        if answer.status_code != 200:
            return f"refused: {answer.status_code} {(await answer.aread())[:300]!r}"
        batch = answer.headers["X-Tether-Batch"]
        reading = asyncio.create_task(answer.aread())
        over = asyncio.create_task(round_over.wait())
        await asyncio.wait([reading, over], return_when=asyncio.FIRST_COMPLETED)
        if reading.done():
            over.cancel()
            return f"ENDED EARLY after {time.perf_counter() - t0:.1f} s: {reading.result()[:300]!r}"
        held = time.perf_counter() - t0
        cancel = await http.delete(f"/api/v1/batches/{batch}")
        result = json.loads(await reading)["results"][0]
        return f"held {held:.1f} s, then DELETE {cancel.status_code}; its result: {result['status']}"


def usage(proc: psutil.Process) -> tuple[float, float]:
    """(RSS in MiB, CPU seconds user+system) of the server process."""
    times = proc.cpu_times()
    return proc.memory_info().rss / 2**20, times.user + times.system


# ---------------------------------------------------------------------------------------------- main

async def main(n_devices: int, seconds: float, callers: int, per_process: int) -> int:
    limit = raise_fd_limit()
    need = n_devices * 2 + callers + 200
    if limit < need:
        sys.exit(f"RLIMIT_NOFILE is {limit}, below the ~{need} descriptors this run needs; raise the hard limit")
    warmup = min(10.0, max(3.0, seconds / 8))
    with tempfile.TemporaryDirectory(prefix="tether-load-") as tmp_name:
        tmp = Path(tmp_name)
        from tether.server.store import Store

        store = Store(str(tmp / "server.db"))  # as `tether token create` does, before the server starts
        t0 = time.perf_counter()
        tokens = {device_name(i): store.tokens.create("device", device_name(i))[1] for i in range(n_devices)}
        api_token = store.tokens.create("api", "load", ["read", "execute"])[1]
        store.close()
        made = time.perf_counter() - t0
        port = free_port()
        url = f"ws://127.0.0.1:{port}/aip"
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(server_process(tmp, port))
            rss_empty, _ = usage(server)
            names = sorted(tokens)
            groups = [names[i:i + per_process] for i in range(0, len(names), per_process)]
            t0 = time.perf_counter()
            pids = await asyncio.gather(*(stack.enter_async_context(
                device_process(url, tmp / "devices", {n: tokens[n] for n in group}, tmp / f"devices-{i}.log"))
                for i, group in enumerate(groups)))
            connect_s = time.perf_counter() - t0
            headers = {"Authorization": f"Bearer {api_token}"}
            admin = await stack.enter_async_context(httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60))
            listed = (await admin.get("/api/v1/devices")).json()
            online = sum(1 for d in listed if d["status"] != "offline")
            assert online == n_devices, f"{online} of {n_devices} devices online"
            rss_idle, idle0 = usage(server)
            idle_t0 = time.perf_counter()
            await asyncio.sleep(3)  # the bench's own pacing: what the idle devices cost the server (heartbeats)
            idle_cpu = (usage(server)[1] - idle0) / (time.perf_counter() - idle_t0)
            echo_port = await stack.enter_async_context(far_end(True, "echo-server"))
            ws = await stack.enter_async_context(connect(f"ws://127.0.0.1:{echo_port}", compression=None,
                                                         max_size=None, ping_interval=None))
            frame = command_frame()
            await anchor_round(ws, frame, 300)
            echo = await anchor_round(ws, frame, ECHO_N)

            clients = [await stack.enter_async_context(httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60,
                limits=httpx.Limits(max_connections=1))) for _ in range(callers)]
            stuck_index = names.index(STUCK)
            stream = Stream(clients, [i for i in range(n_devices) if i != stuck_index])
            workers = [asyncio.create_task(stream.caller(c, seed)) for seed, c in enumerate(clients)]
            print(f"{n_devices} devices registered in {connect_s:.1f} s ({len(groups)} client processes of up to "
                  f"{per_process}; {n_devices} device tokens made in {made:.2f} s); server RSS {rss_empty:.0f} MiB "
                  f"empty, {rss_idle:.0f} MiB with every device idle: "
                  f"{(rss_idle - rss_empty) * 1024 / n_devices:.1f} KiB per idle device (budget 30); "
                  f"server CPU with every device idle {idle_cpu * 100:.1f}% of a core; RLIMIT_NOFILE {limit}")
            print(f"stream: {callers} REST callers, one command per batch ({CHEAP['tool_name']} "
                  f"{json.dumps(CHEAP['parameters'])}), warm-up {warmup:.0f} s, then {seconds:.0f} s in {ROUNDS} "
                  f"rounds (2 and 4: {STUCK} stuck on shell.run sleep 600)")
            await asyncio.sleep(warmup)  # the bench's own pacing: the stream runs meanwhile
            table: list[tuple[float, float, float, float, float, float, int, int, str]] = []
            outcomes: list[str] = []
            start = time.perf_counter()
            rss0, cpu0 = usage(server)
            others = [psutil.Process(), *(psutil.Process(pid) for pid in pids)]  # this process, the devices'
            last_t, last_cpu, last_n, last_others = start, cpu0, 0, [cpu_s(p) for p in others]
            tick = max(1.0, seconds / 16)
            rows_per_round = max(1, round(seconds / ROUNDS / tick))
            for r in range(ROUNDS):
                stuck_task = None
                round_over = asyncio.Event()
                if r % 2 == 1:
                    stuck_task = asyncio.create_task(stuck_command(admin, round_over, str(tmp)))
                stream.round = r
                for _ in range(rows_per_round):
                    await asyncio.sleep(seconds / ROUNDS / rows_per_round)
                    now = time.perf_counter()
                    rss, cpu = usage(server)
                    window = [s.latency for s in stream.samples[last_n:]]
                    spent = [cpu_s(p) for p in others]
                    table.append((now - start, rss, (cpu - last_cpu) / (now - last_t) * 100,
                                  (spent[0] - last_others[0]) / (now - last_t) * 100,
                                  (sum(spent[1:]) - sum(last_others[1:])) / (now - last_t) * 100,
                                  len(window) / (now - last_t), len(stream.errors), r,
                                  f"{pct(window, 50) * 1e3:.2f}/{pct(window, 99) * 1e3:.2f}" if window else "-"))
                    last_t, last_cpu, last_n, last_others = now, cpu, len(stream.samples), spent
                if stuck_task is not None:
                    round_over.set()
                    outcomes.append(await stuck_task)
            stream.round = -1
            elapsed = time.perf_counter() - start
            rss1, cpu1 = usage(server)
            stream.stop = True
            await asyncio.gather(*workers)
            echo += await anchor_round(ws, frame, ECHO_N)

    samples = stream.samples
    print(f"\n   t s   server RSS MiB   server CPU %   callers CPU %   devices CPU %   commands/s   errors   round  "
          f"      p50/p99 ms   (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    for t, rss, cpu, mine, theirs, rate, errors, r, lat in table:
        print(f"{t:6.1f}   {rss:14.1f}   {cpu:12.0f}   {mine:13.0f}   {theirs:13.0f}   {rate:10.0f}   "
              f"{errors:6d}   {r + 1} {'stuck' if r % 2 else 'free ':<5}   {lat:>15}")
    steady = [row[1] for row in table[len(table) // 4:]]
    print(f"\ncommands: {len(samples)} in {elapsed:.1f} s = {len(samples) / elapsed:.0f} commands/s; errors "
          f"{len(stream.errors)}{' (MUST BE 0)' if stream.errors else ''}")
    for error in stream.errors[:5]:
        print(f"  error: {error}")
    cpu_ms = (cpu1 - cpu0) * 1e3 / max(1, len(samples))
    net_ms = (cpu1 - cpu0 - idle_cpu * elapsed) * 1e3 / max(1, len(samples))
    print(f"server: RSS {rss0:.1f} -> {rss1:.1f} MiB over the stream (after the first quarter: min {min(steady):.1f}, "
          f"max {max(steady):.1f} MiB); CPU {(cpu1 - cpu0) / elapsed * 100:.0f}% of a core, {cpu_ms:.3f} ms per "
          f"command ({net_ms:.3f} ms above the idle devices' own cost; budget 0.3 ms)")
    latencies = [s.latency for s in samples]
    base = pct([e * 1e6 for e in echo], 50)
    p50, p99 = pct(latencies, 50) * 1e6, pct(latencies, 99) * 1e6
    print(f"{'anchor: raw websockets echo, across processes':<52} p50 {base:9.1f} us   p99 "
          f"{pct([e * 1e6 for e in echo], 99):9.1f} us   n={len(echo)} (idle, devices connected)")
    print(f"{'tether under load: REST command round trip':<52} p50 {p50:9.1f} us   p99 {p99:9.1f} us   "
          f"n={len(samples)}")
    print(f"ratio under load / echo p50: {p50 / base:.1f}x (with {callers} callers in flight: Little's law puts "
          f"p50 near callers / throughput = {callers / (len(samples) / elapsed) * 1e6:.0f} us)")
    first_process = set(range(min(per_process, n_devices))) - {stuck_index}
    print(f"\nthe stuck device ({STUCK}): {'; '.join(outcomes)}")
    verdict = True
    for label, who in (("every other device", None), (f"its {len(first_process)} neighbours in its client "
                                                         "process", first_process)):
        free = [s.latency * 1e6 for s in samples if s.round % 2 == 0 and (who is None or s.device in who)]
        stuck = [s.latency * 1e6 for s in samples if s.round % 2 == 1 and (who is None or s.device in who)]
        if not free or not stuck:
            print(f"{label}: too few samples")
            continue
        ratio = pct(stuck, 99) / pct(free, 99)
        verdict = verdict and ratio <= 1.5
        print(f"{label:<48} free rounds p50 {pct(free, 50):8.1f} p99 {pct(free, 99):8.1f} us (n={len(free)}); "
              f"stuck rounds p50 {pct(stuck, 50):8.1f} p99 {pct(stuck, 99):8.1f} us (n={len(stuck)}); "
              f"p99 ratio {ratio:.2f}x")
    per_round = [statistics.median([s.latency * 1e6 for s in samples if s.round == r] or [0]) for r in range(ROUNDS)]
    print(f"median per round (us): {', '.join(f'{v:.0f}' for v in per_round)}; "
          f"{'nobody slowed by the stuck device' if verdict else 'NEIGHBOURS SLOWED (p99 > 1.5x)'}")
    ok = not stream.errors and all(o.startswith("held") for o in outcomes)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=120.0, help="length of the measured stream")
    parser.add_argument("--callers", type=int, default=16, help="concurrent REST callers")
    parser.add_argument("--per-process", type=int, default=250, help="devices per client process")
    args = parser.parse_args()
    if args.devices < 2 or args.seconds <= 0 or args.callers < 1 or args.per_process < 1:
        parser.error("--devices >= 2, --seconds > 0, --callers >= 1, --per-process >= 1")
    sys.exit(asyncio.run(main(args.devices, args.seconds, args.callers, args.per_process)))
