"""Several agent servers as one (issue 16): cross-node round trip, 1 vs 3 nodes, and fail-over time.

    python -m bench.cluster [--devices N] [--rounds R] [--seconds S] [--callers C] [--quick] [--db URL]

Everything is real and on this machine: a private `redis-server` on a free port, `tether server`
processes (`--cluster redis://…`, one database shared by the nodes: a SQLite file in a temp directory,
or `--db postgresql://…`), and tether's own `DeviceConnection`s, up to 250 per client process, each
registered with its own device token and given its node's URL first and the other nodes' after it.
The command is the CHEAP one of bench.kit.procs.fleet (`list_tools` of a namespace no tool has: no thread, no I/O).

Rows, each with its anchor measured in the same run, rounds interleaved, medians and spread:
1. what a device's lease costs Redis, with the nodes' own `Directory` on 10,000 leases (`--leases`):
   memory per lease (anchor: the same key without expiry) and one heartbeat's renewal of them all
   (anchor: a bare MGET of the same keys) — the measured base of docs/scaling.md's arithmetic.
2. command round trip, p50 — the caller asks the node that holds the device (anchor) or another node
   (the batch crosses the Redis backplane both ways). Goal: cross-node <= 1.5x same-node.
3. commands/s, C closed-loop REST callers for S seconds a round — N devices on one node that is not
   clustered (anchor), against the same N spread over 3 clustered nodes, each caller asking a random
   node for a random device (so two calls in three cross nodes). Both set-ups run side by side, their
   rounds alternate. On a 2-core machine the 3 nodes share the cores the 1 node has to itself: the
   figure is the backplane's cost, not a scaling figure.
4. kill -9 of one node of 3 -> every device it held registered on another node again (each device
   prints its registrations with a timestamp; no polling). Anchor: the heartbeat timeout + grace
   period the servers run with (the issue's goal is to be inside it).
Big sizes: run niced (`nice -n 10 python -m bench.cluster --devices 1000`) and briefly; the machine
is shared. A heartbeat of 5 s / timeout 15 s / grace 10 s (the server's defaults) is used throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench._stats import fleet_row, pct, spread
from bench.kit.procs.cluster import HEARTBEAT, WAIT, Node, Setup, admin_token, redis_server
from bench.kit.procs.fleet import CHEAP, raise_fd_limit

BODY = {"commands": [CHEAP], "timeout": 30}


# ---------------------------------------------------------------------------------------------- device peer

async def peer_main(state_root: str) -> None:
    """`--peer STATE`: the devices of one JSON line on stdin ({name: [token, [urls]]}) until stdin ends.
    Prints `reg NAME URL UNIXTIME` at each registration, and `ready N` once all N are registered."""
    import logging

    from tether.device.config import parse_device_config
    from tether.device.link.connection import DeviceConnection, LinkHooks, LinkSettings
    from tether.device.local import build_device

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    loop = asyncio.get_running_loop()
    plan: dict[str, list] = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    stop = asyncio.Event()
    eof = loop.run_in_executor(None, sys.stdin.buffer.read)
    eof.add_done_callback(lambda _: loop.call_soon_threadsafe(stop.set))

    def said(state: str, conn: DeviceConnection) -> None:
        if state == "registered":
            print(f"reg {conn.name} {conn.url} {time.time():.6f}", flush=True)

    devices, links, tasks = [], [], []
    try:
        names = sorted(plan)
        for start in range(0, len(names), 50):  # in waves, so the servers' accept queues stay short
            wave = []
            for name in names[start:start + 50]:
                token, urls = plan[name]
                config = parse_device_config({"device": {"name": name, "builtin": ["system"]}})
                device = build_device(config, state_dir=Path(state_root) / name, client_id=name, sandbox=False)
                link = DeviceConnection(device.client, urls, token, name=name,
                                        settings=LinkSettings(connect_timeout=60), hooks=LinkHooks(on_state=said))
                devices.append(device)
                links.append(link)
                tasks.append(asyncio.create_task(link.run()))
                wave.append(link)
            await asyncio.wait_for(asyncio.gather(*(link.connected.wait() for link in wave)), WAIT * 2)
        print(f"ready {len(links)}", flush=True)
        await stop.wait()
    finally:
        for link in links:
            link.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        for device in devices:
            await device.aclose()


# ---------------------------------------------------------------------------------------------- Redis per device

async def redis_costs(redis_port: int, devices: int, repeats: int = 5) -> list[dict[str, object]]:
    """What one node's device leases cost Redis, with tether's own `Directory` (the code a node runs):
    memory per lease (anchor: the same key and value without an expiry) and one heartbeat's renewal
    of all of them (anchor: one bare MGET of the same keys, the floor of any renewal that reads them)."""
    import redis.asyncio as aioredis

    from tether.server.cluster.directory import Directory

    client = aioredis.from_url(f"redis://127.0.0.1:{redis_port}/1", socket_timeout=30)
    try:
        await client.flushdb()
        names = [f"dev-{i:06d}" for i in range(devices)]
        directory = Directory(client, "node-a", lease_s=30)
        await directory.join()
        base = (await client.info("memory"))["used_memory"]
        for start in range(0, devices, 100):
            await asyncio.gather(*(directory.claim(name) for name in names[start:start + 100]))
        await client.connection_pool.disconnect()  # the claims' connections' buffers are not the leases'
        leased = (await client.info("memory"))["used_memory"] - base
        await client.flushdb()
        base = (await client.info("memory"))["used_memory"]
        for start in range(0, devices, 1000):
            async with client.pipeline(transaction=False) as pipe:
                for name in names[start:start + 1000]:
                    pipe.set(Directory.device_key(name), "node-a")
                await pipe.execute()
        plain = (await client.info("memory"))["used_memory"] - base
        await client.flushdb()
        for start in range(0, devices, 100):
            await asyncio.gather(*(directory.claim(name) for name in names[start:start + 100]))
        await directory.join()
        renew: list[float] = []
        mget: list[float] = []
        keys = [Directory.device_key(n) for n in names]
        for _ in range(repeats):
            t0 = time.perf_counter()
            lost = await directory.renew()
            renew.append(time.perf_counter() - t0)
            assert not lost, lost
            t0 = time.perf_counter()
            for start in range(0, devices, 500):
                await client.mget(keys[start:start + 500])
            mget.append(time.perf_counter() - t0)
        commands = 2 + 2 * -(-devices // 500)  # node PEXPIRE script + per 500 devices one MGET and one script
        return [
            fleet_row("Redis memory per device lease", leased / devices, "B", "same key, no expiry",
                      plain / devices, "report", f"{devices} leases: {leased / 2**20:.1f} MiB"),
            fleet_row(f"one heartbeat's renewal of {devices} leases", statistics.median(renew) * 1e3, "ms",
                      "bare MGET of them", statistics.median(mget) * 1e3, "report",
                      f"{commands} Redis commands; rounds {spread([r * 1e3 for r in renew])} ms"),
        ]
    finally:
        await client.flushdb()
        await client.aclose()


# ---------------------------------------------------------------------------------------------- measurements

async def round_trips(http: httpx.AsyncClient, device: str, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        answer = await http.post(f"/devices/{device}/commands", json=BODY)
        samples.append(time.perf_counter() - t0)
        if answer.status_code != 200 or answer.json()["results"][0]["status"] != "success":
            raise RuntimeError(f"a command to {device} failed: {answer.status_code} {answer.text[:300]}")
    return samples


async def closed_loop(setup: Setup, devices: list[str], callers: int, seconds: float) -> tuple[float, int]:
    """C callers, each sending the next command as soon as the last is answered, to a random node of
    `setup` for a random device: (commands/s, failures)."""
    done = 0
    failed = 0
    end = time.perf_counter() + seconds
    clients = list(setup.http.values())

    async def caller(seed: int) -> None:
        nonlocal done, failed
        rng = random.Random(seed)
        while time.perf_counter() < end:
            http = rng.choice(clients)
            try:
                answer = await http.post(f"/devices/{rng.choice(devices)}/commands", json=BODY)
                ok = answer.status_code == 200 and answer.json()["results"][0]["status"] == "success"
            except httpx.HTTPError:
                ok = False
            done += ok
            failed += not ok

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    return done / (time.perf_counter() - t0), failed


async def failover(setup: Setup, victim: Node, tasks: int = 0) -> tuple[float, int, float | None]:
    """kill -9 `victim`; seconds until every device it held has registered at another node, how many, and
    (with `tasks`: that many tasks waiting on a person, started on the victim) seconds until another node
    holds every one of their leases (None without tasks)."""
    held = [name for name, url in setup.holder.items() if url == victim.ws_url]
    if not held:
        raise RuntimeError(f"no device is on {victim.name}")
    task_ids = []
    plan = [{"skill": "get_system_info", "args": {}}]  # a tool the bench's devices have; it never runs
    for _ in range(tasks):  # each waits for a confirmation: leased by the victim, idle
        created = await setup.http[victim.name].post("/tasks", json={"request": "wait", "device": held[0],
                                                                     "plan": plan, "confirm": "always"})
        if created.status_code != 201:
            raise RuntimeError(f"creating a task failed: {created.status_code} {created.text[:300]}")
        task_ids.append(created.json()["id"])
    async with asyncio.timeout(WAIT):
        while tasks and _leases(setup.db, task_ids, victim.name)[0] < len(task_ids):
            await asyncio.sleep(0.05)  # until the victim's leases are in the database
            for task_id in task_ids:
                task = (await setup.http[victim.name].get(f"/tasks/{task_id}", params={"events": False})).json()
                if task.get("state") not in ("created", "planning", "running", "waiting_for_user"):
                    raise RuntimeError(f"a task meant to wait ended {task.get('state')}: {task.get('error')}")
    assert victim.child.proc is not None
    killed = time.time()
    victim.child.proc.send_signal(signal.SIGKILL)
    owned: float | None = None

    async def taken_over() -> None:
        nonlocal owned
        while _leases(setup.db, task_ids, victim.name)[1] < len(task_ids):
            await asyncio.sleep(0.05)  # another process's database rows: polled here, in a benchmark only
        owned = time.time() - killed

    taker = asyncio.create_task(taken_over()) if task_ids else None
    async with asyncio.timeout(HEARTBEAT["timeout"] + HEARTBEAT["grace"] + WAIT):
        while True:
            setup.changed.clear()
            back = [n for n in held if setup.holder[n] != victim.ws_url and setup.registered_at[n] > killed]
            if len(back) == len(held):
                break
            await setup.changed.wait()
        if taker is not None:
            await taker
    return max(setup.registered_at[n] for n in held) - killed, len(held), owned


def _leases(db: str, task_ids: list[str], node: str) -> tuple[int, int]:
    """Of `task_ids`: how many are leased at all, and how many by another node than `node`."""
    marks = ",".join("?" * len(task_ids))
    query = f"SELECT node FROM task_leases WHERE task_id IN ({marks})"
    if db.startswith(("postgresql:", "postgres:")):
        import psycopg

        with psycopg.connect(db) as conn:
            rows = conn.execute(query.replace("?", "%s"), task_ids).fetchall()
    else:
        import sqlite3

        with contextlib.closing(sqlite3.connect(db, timeout=10)) as conn:
            rows = conn.execute(query, task_ids).fetchall()
    return len(rows), sum(r[0] != node for r in rows)


def has_cluster_option() -> bool:
    """Whether this tether's server takes --cluster (the node rows need it)."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "tether.cli", "server", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"})
    return "--cluster" in done.stdout


async def cross_node_round_trip(multi: Setup, names: list[str], rounds: int, n: int) -> dict[str, object]:
    a, b = multi.nodes[0], multi.nodes[1]
    on_a = next(name for name in names if multi.holder[name] == a.ws_url)
    await round_trips(multi.http[a.name], on_a, 10)  # warm-up, both paths
    await round_trips(multi.http[b.name], on_a, 10)
    same: list[float] = []
    cross: list[float] = []
    same_p50: list[float] = []
    cross_p50: list[float] = []
    for r in range(rounds):
        order = [(a, same, same_p50), (b, cross, cross_p50)]
        for node, into, medians in order if r % 2 == 0 else order[::-1]:
            got = await round_trips(multi.http[node.name], on_a, n)
            into += got
            medians.append(statistics.median(got) * 1e3)
    return fleet_row("command round trip, another node holds the device, p50", pct(cross, 50) * 1e3, "ms",
                     "the caller's node holds it", pct(same, 50) * 1e3, "<= 1.5x",
                     f"rounds {spread(cross_p50)} vs {spread(same_p50)} ms; p99 {pct(cross, 99) * 1e3:.2f} vs "
                     f"{pct(same, 99) * 1e3:.2f} ms")


async def one_vs_three(single: Setup, multi: Setup, devices: int, rounds: int, seconds: float,
                       callers: int) -> dict[str, object]:
    single_names, names = sorted(single.holder), sorted(multi.holder)
    await closed_loop(single, single_names, callers, min(seconds, 1.0))  # warm-up
    await closed_loop(multi, names, callers, min(seconds, 1.0))
    one: list[float] = []
    three: list[float] = []
    failures = 0
    for r in range(rounds):
        order = [(single, single_names, one), (multi, names, three)]
        for setup, who, into in order if r % 2 == 0 else order[::-1]:
            rate, failed = await closed_loop(setup, who, callers, seconds)
            into.append(rate)
            failures += failed
    return fleet_row(f"commands/s, {devices} devices on 3 clustered nodes", statistics.median(three), "/s",
                     "1 node", statistics.median(one), "report (2 cores shared)",
                     f"3 nodes {spread(three)}, 1 node {spread(one)}; {callers} callers; {failures} failed")


async def measure(devices: int = 30, rounds: int = 4, seconds: float = 3.0, callers: int = 8, n_rt: int = 200,
                  quick: bool = False, db: str | None = None, leases: int = 10_000) -> list[dict[str, object]]:
    """The rows above. Without --cluster in this tether (issue 16 in progress) the nodes run plain and
    only the Redis rows and the fail-over row (devices moving to the next URL) are measured; the
    others are named as not measured."""
    if quick:
        devices, rounds, seconds, callers, n_rt, leases = min(devices, 6), 2, 1.0, 4, 20, 1000
    have = raise_fd_limit()
    if have < 2 * devices + 500:
        raise RuntimeError(f"RLIMIT_NOFILE is {have}, below the ~{2 * devices + 500} descriptors needed")
    clustered = has_cluster_option()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="tether-cluster-bench-") as name:
        tmp = Path(name)
        async with redis_server(tmp) as redis_port:
            rows += await redis_costs(redis_port, leases)  # its own Redis database (1); the nodes use 0
            single = Setup(tmp / "single", str(tmp / "single" / "server.db"), None)
            multi = Setup(tmp / "multi", db or str(tmp / "multi" / "server.db"), redis_port if clustered else None)
            try:
                for setup in (single, multi) if clustered else (multi,):
                    setup.tmp.mkdir()
                    setup.token = await admin_token(setup.tmp, setup.db)
                for label in ("n1", "n2", "n3"):
                    await multi.start_node(label)
                await multi.start_devices([f"c-{i:05d}" for i in range(devices)], spread_over=multi.nodes)
                if clustered:
                    await single.start_node("solo")
                    await single.start_devices([f"s-{i:05d}" for i in range(devices)], spread_over=single.nodes)
                    rows.append(await cross_node_round_trip(multi, sorted(multi.holder), rounds, n_rt))
                    rows.append(await one_vs_three(single, multi, devices, rounds, seconds, callers))
                else:
                    print("not measured: the cross-node round trip and 1 vs 3 nodes (this tether server has no "
                          "--cluster); the nodes below run plain, sharing one database", flush=True)
                # kill -9 the node holding the most devices
                victim = max(multi.nodes, key=lambda n: sum(u == n.ws_url for u in multi.holder.values()))
                took, moved, owned = await failover(multi, victim, tasks=5)
                budget = HEARTBEAT["timeout"] + HEARTBEAT["grace"]
                kind = "" if clustered else " (plain nodes)"
                rows.append(fleet_row(f"kill -9 a node{kind}: its {moved} devices registered elsewhere", took, "s",
                                      "heartbeat timeout + grace", budget, "<= 1x"))
                if owned is not None:
                    rows.append(fleet_row(f"kill -9 a node{kind}: its 5 waiting tasks owned by another node", owned,
                                          "s", "heartbeat timeout + grace", budget, "<= 1x",
                                          f"task lease = heartbeat timeout ({HEARTBEAT['timeout']:g} s), renewed "
                                          "every third of it"))
            finally:
                await multi.aclose()
                await single.aclose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=30, help="devices per set-up (the issue: 1000)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="closed-loop seconds per round")
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--round-trips", type=int, default=200, help="sequential round trips per round")
    parser.add_argument("--leases", type=int, default=10_000, help="device leases for the Redis cost rows")
    parser.add_argument("--db", help="the clustered nodes' database (e.g. postgresql://…); default a SQLite file")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.peer:
        asyncio.run(peer_main(args.peer))
        return
    asyncio.run(measure(args.devices, args.rounds, args.seconds, args.callers, args.round_trips, args.quick, args.db,
                        args.leases))


if __name__ == "__main__":
    main()
