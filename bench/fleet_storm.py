"""A reconnect storm: N devices connected, the server killed and restarted, time until all N are back.

    python -m bench.fleet_storm [--devices 1000] [--per-process 250] [--quick]

A real `tether server` process (SQLite store in a temp directory) and tether's own `DeviceConnection`s,
K per client process (the device processes of bench.kit.procs.fleet: a real registration each, own device token). Once
all N are registered the server is killed (SIGKILL: no goodbye to the devices) and started again on the
same port and database. Measured from the restart's spawn:
- the time until /api/v1/health answers (anchor: the same server's first start, devices not yet there);
- the time until all N are registered again (`devices_online` of /api/v1/health, probed every 50 ms);
- the /health probes' latency during the storm, p50 and p99 (anchor: the same probes with N idle
  devices before the kill), and how many probes got no answer within 5 s;
- a cheap REST command to one device, repeated whenever it is registered, during the storm (p50 and
  p99; anchor: the same with N idle devices) and how many failed (a timeout of 5 s counts as failed).
The server's admission control (`max_admitting`, HTTP 503 + Retry-After) and the devices' spread first
attempt and full-jitter backoff are what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench._stats import fleet_row, pct
from bench.kit.procs.fleet import CHEAP, DEVICE_NICE, free_port, raise_fd_limit, start_fleet, stop_process

PROBE_EVERY_S = 0.05
PROBE_TIMEOUT_S = 5.0


async def start_server(tmp: Path, port: int, label: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "TETHER_STATE_DIR": str(tmp / "state"), "NO_COLOR": "1"}
    env.pop("TETHER_LLM_BASE_URL", None)
    log = (tmp / f"server-{label}.log").open("wb")
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether.cli", "server", "--port", str(port), "--db", str(tmp / "server.db"),
            "--log-level", "warning", stdout=log, stderr=log, env=env)
    finally:
        log.close()


async def until_health(http: httpx.AsyncClient, proc: asyncio.subprocess.Process, tmp: Path) -> float:
    """Seconds until /api/v1/health answers (polled: uvicorn offers no event for 'started' across processes)."""
    t0 = time.perf_counter()
    for _ in range(1200):
        if proc.returncode is not None:
            raise RuntimeError(f"the server exited; see {tmp}/server-*.log")
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get("/api/v1/health", timeout=PROBE_TIMEOUT_S)).status_code == 200:
                return time.perf_counter() - t0
        await asyncio.sleep(PROBE_EVERY_S)
    raise RuntimeError("the server did not answer /api/v1/health within 60 s")


async def probe(http: httpx.AsyncClient, n: int, limit_s: float) -> tuple[float | None, list[float], int]:
    """Probe /health every PROBE_EVERY_S until `n` devices are online or `limit_s` passed: (seconds until
    all were online or None, latencies of the answered probes, probes unanswered)."""
    t0 = time.perf_counter()
    latencies: list[float] = []
    missed = 0
    while time.perf_counter() - t0 < limit_s:
        p0 = time.perf_counter()
        try:
            answer = await http.get("/api/v1/health", timeout=PROBE_TIMEOUT_S)
            latencies.append(time.perf_counter() - p0)
            if answer.status_code == 200 and answer.json()["devices_online"] >= n:
                return time.perf_counter() - t0, latencies, missed
        except httpx.HTTPError:
            missed += 1
        await asyncio.sleep(PROBE_EVERY_S)
    return None, latencies, missed


async def commands(http: httpx.AsyncClient, name: str, done: asyncio.Event) -> tuple[list[float], list[str]]:
    """Until `done`: a cheap command to `name` whenever it is registered (the commands of a registered device
    must be answered during the storm): (latencies, failures)."""
    latencies: list[float] = []
    failures: list[str] = []
    body = {"commands": [CHEAP], "timeout": 30}
    while not done.is_set():
        try:
            record = await http.get(f"/api/v1/devices/{name}", timeout=PROBE_TIMEOUT_S)
            if record.status_code == 200 and record.json()["status"] != "offline":
                t0 = time.perf_counter()
                answer = await http.post(f"/api/v1/devices/{name}/commands", json=body, timeout=30)
                if answer.status_code == 200 and answer.json()["results"][0]["status"] == "success":
                    latencies.append(time.perf_counter() - t0)
                else:
                    failures.append(f"{answer.status_code} {answer.text[:200]}")
        except httpx.HTTPError as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        await asyncio.sleep(PROBE_EVERY_S)
    return latencies, failures


async def _measure(devices: int, per_process: int, limit_s: float,
                   keep_logs: Path | None = None, nice: int = DEVICE_NICE) -> list[dict[str, object]]:
    from tether.server.store import Store

    have = raise_fd_limit()
    if have < devices + 500:  # the server holds one per device (each device process holds its own share)
        raise RuntimeError(f"RLIMIT_NOFILE is {have}, below the ~{devices + 500} descriptors the server needs")
    with tempfile.TemporaryDirectory(prefix="tether-storm-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "state").mkdir()
        store = Store(str(tmp / "server.db"))
        names = [f"storm-{i:05d}" for i in range(devices)]
        tokens = {n: store.tokens.create("device", n)[1] for n in names}
        api = store.tokens.create("api", "storm", ["read", "execute"])[1]
        store.close()
        port = free_port()
        url = f"ws://127.0.0.1:{port}/aip"
        servers: list[asyncio.subprocess.Process] = []
        try:
            async with contextlib.AsyncExitStack() as stack, httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {api}"}) as http:
                servers.append(await start_server(tmp, port, "first"))
                first_start = await until_health(http, servers[0], tmp)
                t_connect = time.perf_counter()
                await start_fleet(stack, url, tmp / "devices", tokens, per_process, tmp, nice=nice)
                connect_s = time.perf_counter() - t_connect
                print(f"{devices} devices registered in {connect_s:.1f} s ({per_process} per client process)",
                      flush=True)
                idle_done = asyncio.Event()
                idle_commands = asyncio.create_task(commands(http, names[0], idle_done))
                _, idle, _ = await probe(http, devices + 1, 40 * PROBE_EVERY_S)  # N idle devices: the anchor
                idle_done.set()
                idle_cmd, idle_failed = await idle_commands
                servers[0].send_signal(signal.SIGKILL)
                await servers[0].wait()
                t0 = time.perf_counter()
                servers.append(await start_server(tmp, port, "restart"))
                restart_health = await until_health(http, servers[1], tmp)
                storm_done = asyncio.Event()
                storm_commands = asyncio.create_task(commands(http, names[0], storm_done))
                back, storm, missed = await probe(http, devices, limit_s)
                storm_done.set()
                storm_cmd, storm_failed = await storm_commands
                back_s = (time.perf_counter() - t0) if back is not None else float("nan")
        finally:
            for proc in servers:
                await stop_process(proc)
            if keep_logs is not None:
                keep_logs.mkdir(parents=True, exist_ok=True)
                for log in tmp.glob("*.log"):
                    shutil.copy(log, keep_logs / log.name)
    note = f"{devices} devices, {per_process} per process at nice {nice}"
    if idle_failed or storm_failed:  # reported in the table (the goal is not met), the other rows still shown
        print(f"commands failed: {len(idle_failed)} idle, {len(storm_failed)} during the storm, e.g. "
              f"{(idle_failed + storm_failed)[:3]}", file=sys.stderr)
    cmd_ms = [s * 1e3 for s in storm_cmd] or [float("nan")]
    idle_cmd_ms = [s * 1e3 for s in idle_cmd] or [float("nan")]
    ms = [s * 1e3 for s in storm] or [float("nan")]
    idle_ms = [s * 1e3 for s in idle] or [float("nan")]
    return [
        fleet_row(f"restart under {devices} devices: /health answers", restart_health, "s",
                  "first start, no devices", first_start, "<= 1 s", note),
        fleet_row(f"restart under {devices} devices: all registered again", back_s, "s",
                  "restart -> /health", restart_health, "<= 60 s",
                  "NOT all back within the limit" if back is None else note),
        fleet_row("/health p99 during the storm", pct(ms, 99), "ms", "p99 with idle devices", pct(idle_ms, 99),
                  "answered throughout", f"p50 {statistics.median(ms):.3g} ms, {len(storm)} probes, "
                                         f"{missed} unanswered within {PROBE_TIMEOUT_S:g}s"),
        fleet_row("a registered device's command p99 during the storm", pct(cmd_ms, 99), "ms",
                  "p99 with idle devices", pct(idle_cmd_ms, 99), "answered throughout",
                  f"p50 {statistics.median(cmd_ms):.3g} ms, {len(storm_cmd)} commands, {len(storm_failed)} failed "
                  f"({len(idle_failed)} while idle)"),
    ]


def measure(devices: int = 1000, per_process: int = 250, limit_s: float = 300.0,
            quick: bool = False) -> list[dict[str, object]]:
    """The storm's rows for bench/fleet.py."""
    if quick:
        devices, per_process = min(devices, 50), 50
    return asyncio.run(_measure(devices, min(per_process, devices), limit_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--per-process", type=int, default=250)
    parser.add_argument("--limit", type=float, default=300.0, help="give up waiting for all after this many s")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--logs", type=Path, help="copy the server's and the devices' logs here")
    parser.add_argument("--nice", type=int, default=DEVICE_NICE, choices=range(20), metavar="0..19",
                        help=f"the device processes' niceness (default {DEVICE_NICE}; see bench.kit.procs.fleet)")
    args = parser.parse_args()
    if args.quick:
        measure(args.devices, quick=True)
        return
    asyncio.run(_measure(args.devices, min(args.per_process, args.devices), args.limit, args.logs, args.nice))


if __name__ == "__main__":
    main()
