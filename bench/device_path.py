"""A command's path through real `tether device` processes, and one node against its HTTP floor (issue 33, rows 1-3).

    python -m bench.device_path [--devices 10] [--callers 16] [--seconds 3] [--repeats 3] [--trips 400]
                                [--tool list_tools|file_info] [--simulated 10] [--base SRC]
                                [--profile-device SECONDS] [--cprofile-device OUT] [--cprofile-server OUT]

A real `tether server` process (SQLite in a temp directory) and `--devices` real `tether device` processes
(`python -m tether.cli device`, each with its own token, the default log level `info` to a log file, as a
service writes its journal). One cheap built-in command per batch, no subprocess and no thread: `list_tools`
of a namespace no tool has (the default: the link's own cost), or `file_info` of `/tmp` (a files tool: its
policy checks resolve every hidden path on each call, most of that command's device CPU).

Rows, each against its anchors measured in the same run, interleaved round by round:
- REST round trip, sequential, one real device process: one keep-alive HTTP/1.1 connection posting one
  command at a time (a minimal raw client, so the client costs what it costs the anchors); anchors: a
  cross-process `websockets` echo (one connection, a COMMAND-sized frame) and a bare uvicorn + Starlette route
  (its JSON body parsed, a small JSON answered) in its own process, the same raw client. p50 and spread of
  the per-round p50s.
- REST commands/s, `--devices` real device processes, `--callers` closed-loop callers: against the echo's
  round trips/s (one connection) and the bare route's requests/s (the same callers). With it the server's
  CPU per command and each device process's CPU per command (user + system over the round / its commands).
- One node with `--simulated` devices held by one client process (tether's own `DeviceConnection`s, as
  bench.fleet_hotpath): commands/s against the bare route's requests/s (item 3: >= 0.5x). They carry the
  `system` tools alone, so this row always runs the cheap `list_tools`, whatever `--tool` says.
Every answer is read as HTTP/1.1: the count answered chunked rather than with a Content-Length is printed
(the command route answers whole; a chunked answer is a failure of that).

`--profile-device SECONDS`: after the rows, py-spy (when installed) records one device process and the server
for SECONDS while sequential trips run, and prints their top functions by own time. `--base SRC` (another
checkout's `src`, e.g. `git archive BASE src | tar -x -C /tmp/b`): every second device process runs that tree,
and the device CPU per command is printed for each tree (a before/after measured in the same run).
`--cprofile-device OUT`: the first device process runs under cProfile timed by its CPU clock
(`bench.kit.cpu_profile`; slower than real, so are its rows), whose figures go to OUT and are printed at the
end; `--cprofile-server OUT` the same for the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench._stats import pct, spread
from bench.fleet_hotpath import bare_process, echo_rate
from bench.kit.procs.cpu import cpu_exact_s, profile_device, run_queue_s
from bench.kit.procs.devices import real_devices
from bench.kit.procs.fleet import CHEAP, device_process, free_port, raise_fd_limit, server_process
from bench.kit.raw_http import Tally, closed_loop, request_bytes, sequential

TOOLS = {"file_info": {"tool_name": "file_info", "parameters": {"path": "/tmp"}}, "list_tools": CHEAP}


async def echo_trips(ws: object, frame: str, n: int) -> list[float]:
    """`n` round trips of `frame` through the echo connection `ws`, one at a time: each one's seconds."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await ws.send(frame)  # type: ignore[attr-defined]
        await ws.recv()  # type: ignore[attr-defined]
        samples.append(time.perf_counter() - t0)
    return samples

def _row(name: str, value: float, unit: str, spread_text: str, anchors: list[tuple[str, float]]) -> None:
    ratios = "; ".join(f"{a} {v:.4g} {unit} -> {value / v:.2f}x" for a, v in anchors)
    print(f"{name:<58} {value:9.4g} {unit:<4} ({spread_text})  {ratios}")


async def measure(args: argparse.Namespace) -> None:
    """Every row, interleaved round by round, then the report; SystemExit when any answer failed."""
    from websockets.asyncio.client import connect

    from bench.roundtrip import command_frame, far_end
    from tether.server.store import Store

    raise_fd_limit()
    body = json.dumps({"commands": [TOOLS[args.tool]], "timeout": 30}).encode()
    expect = b'"status":"success"'
    with tempfile.TemporaryDirectory(prefix="tether-devpath-") as tmp_name:
        tmp = Path(tmp_name)
        store = Store(str(tmp / "server.db"))
        names = [f"real-{i:02d}" for i in range(args.devices)]
        sims = [f"sim-{i:03d}" for i in range(args.simulated)]
        tokens = {n: store.tokens.create("device", n)[1] for n in [*names, *sims]}
        api = store.tokens.create("api", "devpath", ["read", "execute"])[1]
        store.close()
        port, bare_port = free_port(), free_port()
        tally, bare_tally = Tally(), Tally()
        (tmp / "devices").mkdir()
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(server_process(tmp, port, args.cprofile_server))
            cprofile = args.cprofile_device
            devices = await stack.enter_async_context(real_devices(tmp / "devices", port,
                                                                   {n: tokens[n] for n in names}, api, cprofile,
                                                                   args.base))
            if sims:
                await stack.enter_async_context(device_process(f"ws://127.0.0.1:{port}/aip", tmp / "sims",
                                                               {n: tokens[n] for n in sims}, tmp / "sims.log"))
            bare = await stack.enter_async_context(bare_process(bare_port))
            echo_port = await stack.enter_async_context(far_end(True, "echo-server"))
            echo_proc = next(p for p in psutil.Process().children() if "echo-server" in p.cmdline())
            ws = await stack.enter_async_context(connect(f"ws://127.0.0.1:{echo_port}", compression=None,
                                                         max_size=None, ping_interval=None))
            frame = command_frame()
            one = request_bytes(f"/api/v1/devices/{names[0]}/commands", api, body)
            bare_one = request_bytes("/x", None, body)
            real_reqs = [[request_bytes(f"/api/v1/devices/{names[(c + k) % len(names)]}/commands", api, body)
                          for k in range(len(names))] for c in range(args.callers)]
            # the simulated devices carry the `system` tools alone (bench.load): their row, the node against its
            # HTTP floor, always runs the cheap command, whatever `--tool` the real devices run
            sim_body = json.dumps({"commands": [CHEAP], "timeout": 30}).encode()
            sim_reqs = [[request_bytes(f"/api/v1/devices/{sims[(c + k) % len(sims)]}/commands", api, sim_body)
                         for k in range(len(sims))] for c in range(args.callers)] if sims else []
            bare_reqs = [[bare_one] for _ in range(args.callers)]
            # warm-up of every path
            await echo_trips(ws, frame, 200)
            await sequential(port, one, 200, tally, expect)
            await sequential(bare_port, bare_one, 200, bare_tally, b"success")
            await closed_loop(port, real_reqs, 1.0, [], tally, expect)
            trip_p50: dict[str, list[float]] = {"echo": [], "bare": [], "tether": []}
            trips: dict[str, list[float]] = {"echo": [], "bare": [], "tether": []}
            waited: list[float] = []  # server's and device's run-queue seconds per sequential trip
            trip_cpu: dict[str, list[list[float]]] = {"echo": [], "bare": [], "tether": []}  # far ends' CPU/trip
            rates: dict[str, list[float]] = {"echo": [], "bare": [], "real": [], "sim": []}
            server_cpu: list[float] = []
            device_cpu: list[list[float]] = []
            sim_cpu: list[float] = []
            bare_cpu: list[float] = []
            tally, bare_tally = Tally(), Tally()
            for _ in range(args.repeats):  # interleaved: every row once per round
                for key, run in (("echo", lambda: echo_trips(ws, frame, args.trips)),
                                 ("bare", lambda: sequential(bare_port, bare_one, args.trips, bare_tally, b"success")),
                                 ("tether", lambda: sequential(port, one, args.trips, tally, expect))):
                    far = {"echo": [echo_proc], "bare": [bare], "tether": [server, devices[0]]}[key]
                    queued, cpu0 = run_queue_s([server, devices[0]]), [cpu_exact_s(p) for p in far]
                    samples = await run()
                    trip_cpu[key].append([(cpu_exact_s(p) - c) / len(samples) for p, c in zip(far, cpu0, strict=True)])
                    if key == "tether":
                        waited.append((run_queue_s([server, devices[0]]) - queued) / len(samples))
                    trips[key] += samples
                    trip_p50[key].append(pct(samples, 50))
                rates["echo"].append(await echo_rate(ws, frame, args.seconds))
                rate, cpus = await closed_loop(bare_port, bare_reqs, args.seconds, [bare], bare_tally, b"success")
                rates["bare"].append(rate)
                bare_cpu.append(cpus[0])
                rate, cpus = await closed_loop(port, real_reqs, args.seconds, [server, *devices], tally, expect)
                rates["real"].append(rate)
                server_cpu.append(cpus[0])
                device_cpu.append([c * len(devices) for c in cpus[1:]])  # per command it ran (they share evenly)
                if sim_reqs:
                    rate, cpus = await closed_loop(port, sim_reqs, args.seconds, [server], tally, expect)
                    rates["sim"].append(rate)
                    sim_cpu.append(cpus[0])
            profiles: dict[str, str] = {}
            if args.profile_device:  # the device and the server, sampled at once while sequential trips run
                spies = {f"device process {names[0]}": devices[0].pid, "server": server.pid}
                sampling = {who: asyncio.create_task(asyncio.to_thread(profile_device, pid, args.profile_device,
                                                                       tmp / f"spy-{pid}.txt"))
                            for who, pid in spies.items()}
                while not all(task.done() for task in sampling.values()):
                    await sequential(port, one, 200, tally, expect)
                profiles = {who: task.result() for who, task in sampling.items()}
        for out in (cprofile, args.cprofile_server):
            if out is not None:
                stats = pstats.Stats(str(out)).strip_dirs().sort_stats("tottime")
                stats.print_stats(45)
                stats.sort_stats("cumtime").print_stats(70)
    failed = tally.failed + bare_tally.failed
    load = os.getloadavg()[0]
    print(f"command path: {args.tool} per batch; {args.devices} real `tether device` processes (log level info), "
          f"{args.callers} callers; {args.repeats} interleaved rounds of {args.trips} trips / {args.seconds:g} s; "
          f"{os.cpu_count()} cores, load {load:.1f}")
    p50 = {k: statistics.median(v) * 1e6 for k, v in trip_p50.items()}
    sp = {k: spread([x * 1e6 for x in v]) for k, v in trip_p50.items()}
    print(f"{'anchor: websockets echo, cross-process, p50':<58} {p50['echo']:9.1f} us   ({sp['echo']}) "
          f"p99 {pct(trips['echo'], 99) * 1e6:.0f} us")
    print(f"{'anchor: bare uvicorn+Starlette route, p50':<58} {p50['bare']:9.1f} us   ({sp['bare']}) "
          f"p99 {pct(trips['bare'], 99) * 1e6:.0f} us")
    _row("REST round trip, sequential, real device process, p50", p50["tether"], "us",
         f"{sp['tether']}; p99 {pct(trips['tether'], 99) * 1e6:.0f} us",
         [("echo", p50["echo"]), ("bare route", p50["bare"])])
    print(f"  goal: <= 3x the echo; server and device waited for a core {statistics.median(waited) * 1e6:.0f} us "
          f"per trip ({spread([w * 1e6 for w in waited])}); mean trip {statistics.fmean(trips['tether']) * 1e6:.0f} us")
    cpu = {k: statistics.median(sum(c) for c in v) * 1e6 for k, v in trip_cpu.items()}
    split = [statistics.median(c[i] for c in trip_cpu["tether"]) * 1e6 for i in (0, 1)]
    print(f"  CPU per sequential trip, what the load does not stretch: tether {cpu['tether']:.0f} us (server "
          f"{split[0]:.0f}, device {split[1]:.0f}; spread {spread([sum(c) * 1e6 for c in trip_cpu['tether']])}); "
          f"echo server {cpu['echo']:.0f} us; bare route process {cpu['bare']:.0f} us -> "
          f"{cpu['tether'] / cpu['echo']:.1f}x the echo's far end")
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    print(f"{'anchor: websockets echo round trips/s, one connection':<58} {med['echo']:9.4g} /s   "
          f"({spread(rates['echo'])})")
    print(f"{'anchor: bare uvicorn+Starlette route, closed loop':<58} {med['bare']:9.4g} /s   "
          f"({spread(rates['bare'])}); its CPU per request {statistics.median(bare_cpu) * 1e3:.3f} ms")
    _row(f"REST commands/s, {args.devices} real device processes", med["real"], "/s", spread(rates["real"]),
         [("echo", med["echo"]), ("bare route", med["bare"])])
    print("  goal: >= 0.25x the echo")
    per_device = [statistics.median(c[i] for c in device_cpu) * 1e3 for i in range(len(devices))]
    print(f"  server CPU per command {statistics.median(server_cpu) * 1e3:.3f} ms "
          f"({spread([c * 1e3 for c in server_cpu])}); device CPU per command it ran "
          f"{statistics.median(per_device):.3f} ms (processes {min(per_device):.3f}..{max(per_device):.3f})")
    if args.base is not None and len(per_device) > 1:
        ours, base = per_device[0::2], per_device[1::2]
        print(f"  device CPU per command, this tree {statistics.median(ours):.3f} ms ({min(ours):.3f}.."
              f"{max(ours):.3f}); --base tree {statistics.median(base):.3f} ms ({min(base):.3f}..{max(base):.3f})")
    if rates["sim"]:
        _row(f"one node, {args.simulated} simulated devices (one process, list_tools)", med["sim"], "/s",
             spread(rates["sim"]), [("bare route", med["bare"])])
        print(f"  goal: >= 0.5x the bare route; server CPU per command {statistics.median(sim_cpu) * 1e3:.3f} ms")
    print(f"answers {tally.answers}: {tally.chunked} chunked (goal 0), {tally.failed} failed; bare route "
          f"answers {bare_tally.answers}, {bare_tally.chunked} chunked")
    for who, profile in profiles.items():
        print(f"\npy-spy of the {who} during sequential trips (own time, idle left out):\n{profile}")
    if failed:
        raise SystemExit(f"{failed} failed answers, e.g. {tally.examples + bare_tally.examples}")


def main() -> None:
    """The command line the module docstring shows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trips", type=int, default=400)
    parser.add_argument("--tool", choices=sorted(TOOLS), default="list_tools")
    parser.add_argument("--simulated", type=int, default=10)
    parser.add_argument("--profile-device", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--cprofile-device", type=Path, metavar="OUT", help="run the first device process under "
                        "cProfile timed by its CPU clock (slower than real), write the figures to OUT and print them")
    parser.add_argument("--base", type=Path, metavar="SRC", help="another checkout's src: every second device "
                        "process runs it, and the device CPU rows are split (a before/after in the same run)")
    parser.add_argument("--cprofile-server", type=Path, metavar="OUT", help="the same for the server process")
    args = parser.parse_args()
    if args.devices < 1 or args.callers < 1 or args.repeats < 1:
        sys.exit("--devices, --callers and --repeats must be at least 1")
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
