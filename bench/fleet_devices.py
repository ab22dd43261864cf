"""Idle devices at fleet size: server memory per registered device, the device list's page, start-up.

    python -m bench.fleet_devices [--devices 10000] [--connected 1000] [--per-process 250] [--repeats 3]
                                  [--server-src DIR]

A real `tether server` process (SQLite in a temp directory) and tether's own `DeviceConnection`s, K per
client process, each registering with a real device token and a realistic profile: the one a device with
the shell, files and system built-ins collects (`tether.device.probe.collect_profile`, its real tool
schemas), its hostname made unique per device. The database is filled beforehand, the way the hub
stores devices, so that `--devices` are known in all and `--connected` of them connect.

Rows (anchors measured in the same run, interleaved with the subject):
- server memory per idle registered device: the server's RSS once all `--connected` are registered minus
  its RSS before the first connected, divided by their number; anchor: a bare `websockets` echo server's
  RSS per connection, the same number of connections (one echo each) from a client process;
- `GET /api/v1/devices?limit=100` with `--devices` known: median over a walk of pages (cursor from the
  `Link` header), plain, `status=online` and `tag=lab`; anchor: `GET /api/v1/health` in between;
- the same list without `limit` (every device in one answer), for reference;
- server start with `--devices` known devices: spawn to the first 200 of /api/v1/health, against the same
  with an empty database, alternated `--repeats` times.
`--server-src DIR` runs the server from another checkout's `src` (PYTHONPATH; e.g. `git archive` of an
older commit) for the memory and list rows; its database then holds only the connected devices.

Taken on the 2-core development machine while other work ran (Nov 2026), 10,000 known, 1,000 connected:
server RSS per idle device 39.4 KiB (anchor bare websockets 53.0 KiB in the same run, 0.74x; the server
before issue 13, `--server-src` of a0d5430: 108 KiB vs 52.5 KiB, 2.06x); a page of 100 of 10,000 devices
2.2 ms p50, 5.5 ms p99 (/health 2.5 ms); the unpaged list of 10,000 89 ms; start to /health with 10,000
known devices 2.6 s vs 2.9 s with an empty db (0.89x, n=5; the machine was loaded: 1.1 s empty when quiet).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench._stats import fleet_row, spread
from bench.kit.procs.fleet import free_port, raise_fd_limit, stop_process

PAGE = 100
PAGES = 20  # pages walked per filter and repeat
HEARTBEAT_S = 5.0  # the server's default heartbeat_interval


def device_name(i: int) -> str:
    return f"idle-{i:05d}"


# ---------------------------------------------------------------------------------------------- peers


async def realistic_profile(state: Path) -> Any:
    """The profile a device with the shell, files and system built-ins registers with."""
    from tether.device.config import parse_device_config
    from tether.device.local import build_device
    from tether.device.probe import collect_profile

    config = parse_device_config({"device": {"name": "bench", "builtin": ["shell", "files", "system"]}})
    device = build_device(config, state_dir=state, client_id="bench", serving=False, sandbox=False)
    try:
        return await collect_profile(device, tags=["lab", "bench"], sandbox="none")
    finally:
        await device.aclose()


async def devices_main(url: str, state_root: str) -> None:
    """`--peer devices URL STATE`: devices for the tokens on stdin (one JSON line), until stdin ends."""
    from tether.device.config import parse_device_config
    from tether.device.link.connection import DeviceConnection, LinkSettings
    from tether.device.local import build_device

    loop = asyncio.get_running_loop()
    tokens: dict[str, str] = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    stop = asyncio.Event()
    eof = loop.run_in_executor(None, sys.stdin.buffer.read)
    eof.add_done_callback(lambda _: loop.call_soon_threadsafe(stop.set))
    template = await realistic_profile(Path(state_root) / "template")
    config = parse_device_config({"device": {"name": "bench", "builtin": ["system"]}})
    device = build_device(config, state_dir=Path(state_root) / "shared", client_id="bench", serving=False,
                          sandbox=False)  # commands are not the point: one client behind all links

    def profile_of(name: str) -> Any:
        async def collect() -> Any:
            return template.model_copy(update={"network": template.network.model_copy(update={"hostname": name})})
        return collect

    links, tasks = [], []
    try:
        names = sorted(tokens)
        for start in range(0, len(names), 50):  # in waves, so the server's accept queue stays short
            wave = []
            for name in names[start:start + 50]:
                link = DeviceConnection(device.client, url, tokens[name], name=name, profile=profile_of(name),
                                        settings=LinkSettings(connect_timeout=60))
                links.append(link)
                tasks.append(asyncio.create_task(link.run()))
                wave.append(link)
            await asyncio.wait_for(asyncio.gather(*(link.connected.wait() for link in wave)), 300)
        print(f"ready {len(links)} {len(template.tools)}", flush=True)
        await stop.wait()
    finally:
        for link in links:
            link.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        await device.aclose()


async def echo_server_main() -> None:
    """`--peer echo-server`: a bare websockets echo server; prints its port, serves until stdin ends."""
    from websockets.asyncio.server import serve

    async def echo(ws: Any) -> None:
        async for message in ws:
            await ws.send(message)

    loop = asyncio.get_running_loop()
    async with serve(echo, "127.0.0.1", 0, ping_interval=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"ready {port}", flush=True)
        await loop.run_in_executor(None, sys.stdin.buffer.read)


async def echo_clients_main(port: int, count: int) -> None:
    """`--peer echo-clients PORT N`: N bare connections, one echo each; held until stdin ends."""
    from websockets.asyncio.client import connect

    conns = []
    try:
        for start in range(0, count, 100):
            wave = await asyncio.gather(*(connect(f"ws://127.0.0.1:{port}", ping_interval=None, open_timeout=60)
                                          for _ in range(min(100, count - start))))
            for ws in wave:
                await ws.send("x" * 64)
                await ws.recv()
            conns += wave
        print(f"ready {len(conns)}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    finally:
        for ws in conns:
            with contextlib.suppress(Exception):
                await ws.close()


# ---------------------------------------------------------------------------------------------- processes


@asynccontextmanager
async def peer(*args: str, stdin_line: bytes | None = None, log: Path) -> AsyncIterator[tuple[int, str]]:
    """A `python -m bench.fleet_devices --peer …` child; yields (pid, its ready line) until it is stopped."""
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.fleet_devices", "--peer", *args,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=err)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if stdin_line is not None:
            proc.stdin.write(stdin_line + b"\n")
            await proc.stdin.drain()
        line = (await asyncio.wait_for(proc.stdout.readline(), 600)).decode()
        if not line.startswith("ready"):
            raise RuntimeError(f"peer {args[0]} failed: {log.read_text(errors='replace')[-2000:]}")
        yield proc.pid, line
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def server(tmp: Path, db: Path, label: str, src: Path | None = None) -> AsyncIterator[tuple[int, float, int]]:
    """A `tether server` on `db`; yields (port, seconds from spawn to the first 200 of /api/v1/health, pid)."""
    port = free_port()
    env = {**os.environ, "TETHER_STATE_DIR": str(tmp / "state"), "NO_COLOR": "1"}
    env.pop("TETHER_LLM_BASE_URL", None)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    with (tmp / f"server-{label}.log").open("wb") as log:
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether.cli", "server", "--port", str(port), "--db", str(db),
            "--log-level", "warning", stdout=log, stderr=log, env=env)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            while True:  # across processes there is no "started" event: probe, bounded
                if proc.returncode is not None or time.perf_counter() - started > 120:
                    raise RuntimeError(f"server {label} did not answer /health: "
                                       f"{(tmp / f'server-{label}.log').read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get("/api/v1/health")).status_code == 200:
                        break
                await asyncio.sleep(0.005)
        yield port, time.perf_counter() - started, proc.pid
    finally:
        await stop_process(proc)


def fill(db: Path, known: int, connected: int, profile: Any) -> tuple[dict[str, str], str]:
    """`known` devices stored the way the hub stores them, device tokens for the first `connected`, and
    an API token (read)."""
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.store import Store

    store = Store(db)
    try:
        registry = DeviceRegistry()
        now = time.time()
        digest = tools_json = None
        for i in range(known):
            name = device_name(i)
            record = registry.ensure(name)
            record.profile = profile.model_copy(update={"network": profile.network.model_copy(
                update={"hostname": name})})
            if digest is None:
                digest, tools_json = record.tools_digest, registry.tools.dump(record.profile.tools)
            store.devices.upsert(name, record.profile.model_dump_json(exclude={"tools"}), now - i,
                                tools=(digest, tools_json))
            registry.forget(name)
        tokens = {device_name(i): store.tokens.create("device", device_name(i))[1] for i in range(connected)}
        return tokens, store.tokens.create("api", "bench-reader", ["read"])[1]
    finally:
        store.close()


async def fill_with(src: Path, db: Path, connected: int) -> tuple[dict[str, str], str]:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.fleet_devices", "--peer", "fill",
                                                str(db), str(connected), stdout=asyncio.subprocess.PIPE, env=env)
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    if proc.returncode != 0:
        raise RuntimeError(f"filling {db} with {src}'s store failed")
    answer = json.loads(out)
    return answer["tokens"], answer["reader"]


def fill_tokens(db: Path, connected: int) -> None:
    """`--peer fill DB N`: device tokens and a reader token, made by whichever tether is importable."""
    from tether.server.store import Store

    store = Store(db)
    try:
        tokens = {device_name(i): store.tokens.create("device", device_name(i))[1] for i in range(connected)}
        print(json.dumps({"tokens": tokens, "reader": store.tokens.create("api", "bench-reader", ["read"])[1]}))
    finally:
        store.close()


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


async def devices_up(tmp: Path, url: str, tokens: dict[str, str], per_process: int,
                     stack: contextlib.AsyncExitStack) -> int:
    """Start the client processes for `tokens`; returns the tool count of the profile they register with."""
    names = sorted(tokens)
    groups = [names[i:i + per_process] for i in range(0, len(names), per_process)]
    lines = await asyncio.gather(*(stack.enter_async_context(peer(
        "devices", url, str(tmp / f"dev{n}"), stdin_line=json.dumps({k: tokens[k] for k in group}).encode(),
        log=tmp / f"devices-{n}.log")) for n, group in enumerate(groups)))
    return int(lines[0][1].split()[2])


async def echo_per_connection(tmp: Path, count: int) -> float:
    """A bare websockets server's RSS per connection (bytes), `count` connections with one echo each."""
    async with peer("echo-server", log=tmp / "echo-server.log") as (pid, line):
        port = int(line.split()[1])
        before = rss(pid)
        async with peer("echo-clients", str(port), str(count), log=tmp / "echo-clients.log"):
            return (rss(pid) - before) / count


async def timed_get(http: httpx.AsyncClient, url: str) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    answer = await http.get(url)
    elapsed = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"GET {url}: {answer.status_code} {answer.text[:200]}")
    return elapsed, answer


async def list_pages(http: httpx.AsyncClient, repeats: int) -> tuple[list[float], list[float]]:
    """Page times and /health times, alternated, over walks of PAGES pages per filter."""
    pages: list[float] = []
    health: list[float] = []
    for _ in range(repeats):
        for query in ("", "&status=online", "&tag=lab"):
            url: str | None = f"/api/v1/devices?limit={PAGE}{query}"
            for _ in range(PAGES):
                if url is None:
                    break
                elapsed, answer = await timed_get(http, url)
                pages.append(elapsed)
                health.append((await timed_get(http, "/api/v1/health"))[0])
                link = answer.headers.get("link")
                url = link[1:link.index(">")] if link else None
    return pages, health


async def _measure(devices: int, connected: int, per_process: int, repeats: int,
                   src: Path | None) -> list[dict[str, object]]:
    raise_fd_limit()
    connected = min(connected, devices)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="tether-fleet-devices-") as name:
        tmp = Path(name)
        profile = await realistic_profile(tmp / "template")
        known = devices if src is None else connected
        print(f"profile: {len(profile.tools)} tools, {len(profile.model_dump_json())} bytes of JSON; "
              f"{devices} devices, {connected} connected, {per_process} per client process", flush=True)

        # -- start-up: empty database against `devices` known ones, alternated
        if src is None:
            full, empty = tmp / "known.db", tmp / "empty.db"
            fill(full, devices, 0, profile)
            fill(empty, 0, 0, profile)
            starts: dict[str, list[float]] = {"empty": [], "known": []}
            for i in range(repeats):
                for label, db in (("empty", empty), ("known", full)):
                    async with server(tmp, db, f"{label}{i}") as (_, took, _pid):
                        starts[label].append(took)
            known_s, empty_s = statistics.median(starts["known"]), statistics.median(starts["empty"])
            rows.append(fleet_row(f"server start with {devices} known devices: /health", known_s, "s",
                                  "empty db", empty_s, "<= 1 s", f"spread {spread(starts['known'])} vs "
                                                                 f"{spread(starts['empty'])}, n={repeats}"))

        # -- memory per idle device, and the list, on one server with `devices` known, `connected` up
        db = tmp / "fleet.db"
        if src is None:
            tokens, reader = fill(db, known, connected, profile)
        else:  # the older server's own store makes the database (a newer schema would be refused)
            tokens, reader = await fill_with(src, db, connected)
        anchors = [await echo_per_connection(tmp, connected)]
        async with server(tmp, db, "fleet", src) as (port, _, pid), contextlib.AsyncExitStack() as stack, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                  headers={"Authorization": f"Bearer {reader}"}) as http:
            # every known device's stored profile read (the server does so in the background after start)
            # and the route warm, so that what follows is what the connected devices add
            await timed_get(http, "/api/v1/devices")
            before = rss(pid)
            tool_count = await devices_up(tmp, f"ws://127.0.0.1:{port}/aip", tokens, per_process, stack)
            online = (await timed_get(http, "/api/v1/health"))[1].json()["devices_online"]
            if online != connected:
                raise RuntimeError(f"{online} devices online, expected {connected}")
            # idle means past registration: uvicorn keeps a socket's last message (the ~8 KB register
            # frame) until the next one, so wait until every device has sent a heartbeat since
            await asyncio.sleep(HEARTBEAT_S + 1)
            per_device = (rss(pid) - before) / connected
            anchors.append(await echo_per_connection(tmp, connected))
            anchor = statistics.fmean(anchors)
            rows.append(fleet_row(f"server memory per idle device ({connected} registered)", per_device / 1024,
                                  "KiB", "bare websockets connection", anchor / 1024, "<= 30 KiB",
                                  f"{tool_count}-tool profile; anchor {spread([a / 1024 for a in anchors])}"))
            pages, health = await list_pages(http, repeats)
            p99 = 1e3 * sorted(pages)[int(.99 * len(pages))]
            rows.append(fleet_row(f"GET /api/v1/devices?limit={PAGE}, {devices} devices",
                                  1e3 * statistics.median(pages), "ms", "GET /api/v1/health",
                                  1e3 * statistics.median(health), "<= 50 ms",
                                  f"plain, status=online, tag=lab; n={len(pages)}, p99 {p99:.3g} ms"))
            whole = [(await timed_get(http, "/api/v1/devices"))[0] for _ in range(max(repeats, 3))]
            rows.append(fleet_row(f"GET /api/v1/devices (no limit), {devices} devices",
                                  1e3 * statistics.median(whole), "ms", "GET /api/v1/health",
                                  1e3 * statistics.median(health), "-",
                                  f"every device in one answer; spread {spread([1e3 * w for w in whole])} ms"))
    return rows


async def measure(devices: int = 10_000, connected: int = 1000, per_process: int = 250, repeats: int = 3,
                  server_src: str | None = None) -> list[dict[str, object]]:
    """The rows for bench/fleet.py; `connected` of `devices` known devices register."""
    return await _measure(devices, connected, per_process, repeats, Path(server_src) if server_src else None)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--peer":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "devices":
            asyncio.run(devices_main(rest[0], rest[1]))
        elif kind == "echo-server":
            asyncio.run(echo_server_main())
        elif kind == "fill":
            fill_tokens(Path(rest[0]), int(rest[1]))
        elif kind == "echo-clients":
            asyncio.run(echo_clients_main(int(rest[0]), int(rest[1])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=10_000, help="known devices in the database")
    parser.add_argument("--connected", type=int, default=1000, help="of those, how many connect")
    parser.add_argument("--per-process", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--server-src", help="run the server from this src directory (an older checkout)")
    args = parser.parse_args()
    asyncio.run(measure(args.devices, args.connected, args.per_process, args.repeats, args.server_src))


if __name__ == "__main__":
    main()
