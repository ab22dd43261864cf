"""Two trees' servers under the very same load: server CPU per REST command, this tree against another's.

    python -m bench.server_pair --base SRC [--devices 10] [--callers 16] [--seconds 2] [--repeats 5]
                                [--log-level warning|info]

On a shared machine a server's CPU per command follows its throughput (more commands per loop turn and
per system call when it is busier), and the throughput follows whatever else runs: two runs one after the
other compare the machine's moods more than the trees. Here both run at once. A real `tether server`
of this tree and one of `SRC` (another checkout's `src`, e.g. `git archive BASE src | tar -x -C /tmp/b`),
each with its own SQLite database and its own client process of `--devices` devices (`bench.load`, this
tree's devices for both), and `--callers` closed-loop callers, each alternating one command to this tree's server and
one to the other's (`list_tools` of a namespace no tool has, as bench.fleet_hotpath), so that both see the
same concurrency at the same moments. Both servers log at `--log-level` (warning by default; at info, what
`tether server` runs by default, each request also writes an access line).
Per round: each server's CPU (its threads' scheduled time, to the
nanosecond) over the answers it gave, and their ratio; printed: medians and spread over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from bench._stats import spread
from bench.fleet_hotpath import read_response, request_bytes
from bench.kit.procs.cpu import cpu_exact_s
from bench.kit.procs.fleet import tree
from bench.load import device_process, free_port, raise_fd_limit, server_process

TOKENS = """
import json, sys
from tether.server.store import Store
store = Store(sys.argv[1])
create = store.tokens.create if hasattr(store, "tokens") else store.create_token
names = json.loads(sys.argv[2])
print(json.dumps({"devices": {n: create("device", n)[1] for n in names},
                  "api": create("api", "pair", ["read", "execute"])[1]}))
store.close()
"""


async def caller(ports: list[int], requests: list[list[bytes]], until: float, counts: list[int],
                 errors: list[str]) -> None:
    streams = [await asyncio.open_connection("127.0.0.1", port) for port in ports]
    i = 0
    try:
        while time.perf_counter() < until:
            for side, (reader, writer) in enumerate(streams):
                writer.write(requests[side][i % len(requests[side])])
                status, body = await asyncio.wait_for(read_response(reader), 60)
                if status != 200 or b'"status":"success"' not in body:
                    errors.append(f"{status} {body[:200]!r}")
                counts[side] += 1
            i += 1
    finally:
        for _, writer in streams:
            writer.close()


async def measure(base: Path, devices: int, callers: int, seconds: float, repeats: int,
                  log_level: str = "warning") -> None:
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="tether-pair-") as tmp_name:
        tmp = Path(tmp_name)
        sides: list[tuple[str, Path | None]] = [("this tree", None), ("base", base.resolve())]
        servers: list[psutil.Process] = []
        ports: list[int] = []
        requests: list[list[list[bytes]]] = [[] for _ in range(callers)]
        async with contextlib.AsyncExitStack() as stack:
            for k, (_, src) in enumerate(sides):
                side_dir = tmp / f"side{k}"
                side_dir.mkdir()
                names = [f"pair{k}-{i:03d}" for i in range(devices)]
                env = {**os.environ, **({"PYTHONPATH": str(src)} if src is not None else {})}
                made = json.loads(subprocess.run([sys.executable, "-c", TOKENS, str(side_dir / "server.db"),
                                                  json.dumps(names)], env=env, check=True, capture_output=True,
                                                 text=True).stdout)
                port = free_port()
                with tree(src):
                    servers.append(await stack.enter_async_context(server_process(side_dir, port, log_level=log_level)))
                await stack.enter_async_context(device_process(f"ws://127.0.0.1:{port}/aip",
                                                               side_dir / "devices", made["devices"],
                                                               side_dir / "devices.log"))
                ports.append(port)
                for c in range(callers):
                    requests[c].append([request_bytes(f"/api/v1/devices/{names[(c + j) % devices]}/commands",
                                                      made["api"]) for j in range(devices)])
            errors: list[str] = []
            per_cmd: list[list[float]] = [[], []]
            ratios: list[float] = []
            rates: list[float] = []
            for round_ in range(repeats + 1):  # the first round warms both up and is not counted
                counts = [0, 0]
                cpu0 = [cpu_exact_s(p) for p in servers]
                t0 = time.perf_counter()
                await asyncio.gather(*(caller(ports, requests[c], t0 + (seconds if round_ else 1.0), counts,
                                              errors) for c in range(callers)))
                elapsed = time.perf_counter() - t0
                cpu = [(cpu_exact_s(p) - c0) / max(n, 1) for p, c0, n in zip(servers, cpu0, counts, strict=True)]
                if round_:
                    for k in (0, 1):
                        per_cmd[k].append(cpu[k] * 1e3)
                    ratios.append(cpu[0] / cpu[1])
                    rates.append(sum(counts) / elapsed)
    if errors:
        raise SystemExit(f"{len(errors)} failed commands, e.g. {errors[:3]}")
    print(f"server pair: {devices} devices per server, {callers} callers alternating, {repeats} rounds of "
          f"{seconds:g} s, servers logging at {log_level}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"base {base}")
    for k, (label, _) in enumerate(sides):
        print(f"{'server CPU per REST command, ' + label:<48} {statistics.median(per_cmd[k]):.4f} ms   "
              f"({spread(per_cmd[k])})")
    print(f"{'ratio this tree / base, per round':<48} {statistics.median(ratios):.3f}x   ({spread(ratios)}); "
          f"both servers' answers {statistics.median(rates):.0f}/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, metavar="SRC", help="the other checkout's src")
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="both servers' (`tether server` runs at info by default: an access line per request)")
    args = parser.parse_args()
    if args.devices < 1 or args.callers < 1 or args.repeats < 1 or not (args.base / "tether").is_dir():
        sys.exit("--devices, --callers and --repeats must be at least 1, and --base a src holding tether/")
    asyncio.run(measure(args.base, args.devices, args.callers, args.seconds, args.repeats, args.log_level))


if __name__ == "__main__":
    main()
