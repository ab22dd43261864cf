"""A fleet of real `tether device` processes riding out a server outage: how soon all are back, and how hard they
knocked meanwhile.

    python -m bench.reconnect_storm [--devices 20] [--down 8] [--grace 3] [--repeats 3] [--idle] [--base SRC]

A real `tether server` process (SQLite in a temp directory; `--grace` seconds of grace period, heartbeats every
0.3 s) and `--devices` real `tether device` processes (`python -m tether.cli device`, each with its own token,
its log at `info` as JSON lines to a file). Each device is given a command that outlives the outage (an
unconfined `sleep`), so each owes the server a result and paces its attempts by the grace window (`--idle`: no
command, so no window). Then the server is killed (SIGKILL: no goodbye), stays down `--down` seconds, and is
started again on the same port and database. Read from the devices' own log lines (their timestamps), per run:
- restart -> all registered again: from the restart's spawn to the last device's "registered as" line;
  anchor: restart -> the server's /api/v1/health answering (nothing can register before it), measured in the
  same run; and their difference, /health -> all registered (the devices' own share: on a loaded machine the
  server's start is most of the first);
- attempts per device during the outage (each failed attempt logs the wait it plans: "reconnecting in …"),
  median and the most of any device;
- the fleet's peak connection-attempt rate: the most attempts of all devices in any one second;
- the longest wait any device planned outside a grace window (once it had closed; with `--idle`, any wait): the
  defect this bench was written for: the window's dense attempts used to raise the backoff step to the cap, so
  the first wait after it was drawn from 0-30 s;
- the devices' CPU (user + system of every device process) from the kill until all are registered again, per
  attempt (the failed ones and the registration).

`--base SRC` (another checkout's `src`, e.g. `git archive main src | tar -x -C /tmp/b`): each repeat runs the
fleet from this tree and from SRC back to back (the order alternating), the server always from this tree (only
the devices' schedule differs), and prints the ratio of their medians. Every figure is the median over
`--repeats` runs with the spread (min..max); the load average is printed at the start and the end. The devices
share the server's cores here: wall times are the schedule's (seconds of waiting), not CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil

from bench._stats import spread
from bench.kit.procs.devices import device_env
from bench.kit.procs.fleet import cpu_s, free_port, stop_process

HEARTBEAT = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2"]
START_S = 120.0  # devices registered, commands running: within this, or the run fails


@dataclass
class Run:
    """One outage of one fleet: seconds from the restart's spawn, and what the devices' logs said."""

    health_s: float  # restart -> /health answers
    all_back_s: float  # restart -> the last device registered
    attempts: list[int]  # failed attempts per device during the outage
    peak_per_s: int  # the most attempts of the fleet in any one second
    longest_after_window_s: float  # the longest wait planned once a device's grace window had closed
    cpu_s: float = 0.0  # the devices' CPU (user + system, all of them) from the kill to all registered again


def _ts(text: str) -> float:
    """A JSON log line's `ts` (UTC, milliseconds) as a Unix time."""
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def _records(log: Path) -> list[tuple[float, str]]:
    """(time, message) of a device's JSON log lines."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError, KeyError):
                entry = json.loads(line)
                out.append((_ts(entry["ts"]), entry["message"]))
    return out


async def _server(tmp: Path, port: int, grace: float, label: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "TETHER_STATE_DIR": str(tmp / "state"), "NO_COLOR": "1"}
    env.pop("TETHER_LLM_BASE_URL", None)
    env.pop("PYTHONPATH", None)  # the server always runs this tree
    with (tmp / f"server-{label}.log").open("wb") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tether.cli", "server", "--port", str(port), "--db", str(tmp / "server.db"),
            "--grace-period", str(grace), *HEARTBEAT, "--log-level", "warning", stdout=log, stderr=log, env=env)


async def _until(check: Callable[[], Awaitable[bool]], what: str, limit: float,
                 procs: list[asyncio.subprocess.Process]) -> None:
    """Poll `check` (an async callable) until true: another process's state, no event crosses to us."""
    deadline = time.monotonic() + limit
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if await check():
                return
        for proc in procs:
            if proc.returncode is not None:
                raise RuntimeError(f"{what}: a process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {limit:g} s")
        await asyncio.sleep(0.05)


async def one_run(args: argparse.Namespace, base: Path | None) -> Run:
    from tether.server.store import Store

    with tempfile.TemporaryDirectory(prefix="tether-storm-") as tmp_name:
        tmp = Path(tmp_name)
        store = Store(str(tmp / "server.db"))
        names = [f"storm-{i:03d}" for i in range(args.devices)]
        tokens = {n: store.tokens.create("device", n)[1] for n in names}
        api = store.tokens.create("api", "storm", ["read", "execute"])[1]
        store.close()
        port = free_port()
        env, argv_root = device_env(tmp)
        (tmp / "device.yaml").write_text("device:\n  builtin: [shell]\n")
        # the command is an unconfined `sleep`: the sandbox is not what is measured (and a root bench's devices
        # have no unprivileged user to run one as)
        (tmp / "policy.yaml").write_text("sandbox: false\nrequire_sandbox: false\n")
        if base is not None:
            env["PYTHONPATH"] = str(base)
        server = await _server(tmp, port, args.grace, "first")
        devices: list[asyncio.subprocess.Process] = []
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {api}"},
                                 timeout=10)
        calls: list[asyncio.Task[httpx.Response]] = []
        try:
            await _until(lambda: _health(http), "the server started", START_S, [server])
            for name in names:
                (tmp / name).mkdir()
                (tmp / name / "token").write_text(tokens[name])
                with (tmp / f"{name}.log").open("wb") as log:
                    devices.append(await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "tether.cli", "device", "--server", f"ws://127.0.0.1:{port}/aip",
                        "--name", name, "--token-file", str(tmp / name / "token"), "--state-dir", str(tmp / name),
                        "--log-format", "json", "--policy", str(tmp / "policy.yaml"), *argv_root,
                        stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env=env))
            await _until(lambda: _online(http, len(names)), "every device registered", START_S, [server, *devices])
            if not args.idle:
                sleep = {"tool_name": "shell.run", "parameters": {"cmd": "sleep", "argv": ["600"], "cwd": str(tmp)}}
                body = {"commands": [sleep], "timeout": 900}
                calls = [asyncio.create_task(http.post(f"/api/v1/devices/{n}/commands", json=body, timeout=None))
                         for n in names]
                await _until(lambda: _busy(http, len(names), calls), "every device running its command", START_S,
                             [server, *devices])
            watched = [psutil.Process(p.pid) for p in devices]
            cpu_before = sum(cpu_s(p) for p in watched)
            server.send_signal(signal.SIGKILL)
            await server.wait()
            down_at = time.time()
            await asyncio.sleep(args.down)  # the outage itself: this long, whatever the devices do
            restart_at = time.time()
            server = await _server(tmp, port, args.grace, "restart")
            await _until(lambda: _health(http), "the server restarted", START_S, [server])
            health_s = time.time() - restart_at
            await _until(lambda: _online(http, len(names)), "every device back", START_S, [server, *devices])
            fleet_cpu = sum(cpu_s(p) for p in watched) - cpu_before
        finally:
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await http.aclose()
            await asyncio.gather(*(stop_process(p, grace=15) for p in devices))
            await stop_process(server)
        run = _read(tmp, names, down_at, restart_at, health_s)
        run.cpu_s = fleet_cpu
        return run


def _read(tmp: Path, names: list[str], down_at: float, restart_at: float, health_s: float) -> Run:
    attempts, times, back, longest = [], [], [], 0.0
    for name in names:
        records = [(t, m) for t, m in _records(tmp / f"{name}.log") if t >= down_at - 1.0]
        mine = 0
        for t, message in records:
            if message.startswith("registered as") and t >= restart_at:
                back.append(t - restart_at)
                break
            if message.startswith("reconnecting in"):
                mine += 1
                times.append(t)
                if "grace period" not in message:
                    longest = max(longest, float(message.split()[2].rstrip("s")))
        else:
            raise RuntimeError(f"{name} never logged its registration after the restart: see {tmp}")
        attempts.append(mine)
    # the most attempts in any one second (a sliding window over every attempt's time, not whole seconds)
    times.sort()
    peak, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - 1.0:
            j += 1
        peak = max(peak, i - j + 1)
    return Run(health_s, max(back), attempts, peak, longest)


async def _health(http: httpx.AsyncClient) -> bool:
    return (await http.get("/api/v1/health")).status_code == 200


async def _online(http: httpx.AsyncClient, n: int) -> bool:
    answer = await http.get("/api/v1/health")
    return answer.status_code == 200 and answer.json()["devices_online"] >= n


async def _busy(http: httpx.AsyncClient, n: int, calls: list[asyncio.Task[httpx.Response]]) -> bool:
    for call in calls:
        if call.done():
            raise RuntimeError(f"a command ended before the outage: {call.result().text[:500]}")
    answer = await http.get("/api/v1/devices")
    rows = answer.json() if answer.status_code == 200 else []
    rows = rows.get("devices", rows) if isinstance(rows, dict) else rows
    return sum(1 for row in rows if row.get("status") == "busy") >= n


def _show(label: str, runs: list[Run]) -> dict[str, float]:
    back = [r.all_back_s for r in runs]
    health = [r.health_s for r in runs]
    ratio = [r.all_back_s / r.health_s for r in runs]
    late = [r.all_back_s - r.health_s for r in runs]  # the devices' own share: the server answered, they waited
    per_device = [statistics.median(r.attempts) for r in runs]
    most = [float(max(r.attempts)) for r in runs]
    peak = [float(r.peak_per_s) for r in runs]
    longest = [r.longest_after_window_s for r in runs]
    cpu_ms = [1000 * r.cpu_s / max(sum(r.attempts) + len(r.attempts), 1) for r in runs]
    med = {"cpu_ms": statistics.median(cpu_ms),
           "back": statistics.median(back), "health": statistics.median(health), "ratio": statistics.median(ratio),
           "attempts": statistics.median(per_device), "peak": statistics.median(peak),
           "longest": statistics.median(longest), "late": statistics.median(late)}
    print(f"[{label}]")
    print(f"  restart -> all registered        {med['back']:7.2f} s   ({spread(back)})   anchor restart -> /health "
          f"{med['health']:.2f} s ({spread(health)}) -> {med['ratio']:.2f}x ({spread(ratio)})")
    print(f"  /health -> all registered        {med['late']:7.2f} s   ({spread(late)})")
    print(f"  failed attempts per device      {med['attempts']:7.1f}     (medians {spread(per_device)}; the most of "
          f"any device {spread(most)})")
    print(f"  peak attempts of the fleet      {med['peak']:7.0f} /s  ({spread(peak)})")
    print(f"  longest wait planned outside a grace window {med['longest']:.2f} s ({spread(longest)})")
    print(f"  devices' CPU per attempt        {med['cpu_ms']:7.1f} ms  ({spread(cpu_ms)}; from the kill to all "
          "registered, over every attempt and the registration)")
    return med


async def measure(args: argparse.Namespace) -> None:
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.devices} real devices, "
          f"{'idle' if args.idle else 'each owing a result'}, server down {args.down:g} s, grace {args.grace:g} s, "
          f"{args.repeats} repeats{', interleaved with ' + str(args.base) if args.base else ''}", flush=True)
    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.base is not None:
        trees.append((f"base {args.base}", args.base))
    runs: dict[str, list[Run]] = {label: [] for label, _ in trees}
    for repeat in range(args.repeats):
        for label, src in (trees if repeat % 2 == 0 else trees[::-1]):
            run = await one_run(args, src)
            runs[label].append(run)
            print(f"  run {repeat + 1} {label}: all back {run.all_back_s:.2f} s after the restart (/health "
                  f"{run.health_s:.2f} s), attempts/device median {statistics.median(run.attempts):g}, peak "
                  f"{run.peak_per_s}/s, longest wait outside a window {run.longest_after_window_s:.2f} s, devices' "
                  f"CPU {run.cpu_s:.2f} s", flush=True)
    meds = {label: _show(label, found) for label, found in runs.items()}
    if args.base is not None:
        new, old = meds["this tree"], meds[trees[1][0]]
        print(f"this tree / base: restart -> all registered {new['back'] / old['back']:.2f}x; /health -> all "
              f"registered {new['late'] / max(old['late'], 1e-9):.2f}x; attempts per device "
              f"{new['attempts'] / max(old['attempts'], 1e-9):.2f}x; peak attempt rate "
              f"{new['peak'] / max(old['peak'], 1e-9):.2f}x; devices' CPU per attempt "
              f"{new['cpu_ms'] / max(old['cpu_ms'], 1e-9):.2f}x")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reconnect_storm", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=20, help="real tether device processes (default 20)")
    parser.add_argument("--down", type=float, default=8.0, help="seconds the server stays down (default 8)")
    parser.add_argument("--grace", type=float, default=3.0, help="the server's grace period, s (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tree (default 3)")
    parser.add_argument("--idle", action="store_true", help="devices owe nothing: no grace window")
    parser.add_argument("--base", type=Path, help="another checkout's src: its devices run interleaved")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.repeats < 1 or args.down < 0 or args.grace < 0:
        parser.error("--devices and --repeats must be >= 1, --down and --grace >= 0")
    if args.base is not None and not (args.base / "tether").is_dir():
        parser.error(f"--base {args.base}: no tether package there (give a checkout's src)")
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
