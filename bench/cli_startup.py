"""CPU time of tether's start-up, each against a bare-interpreter anchor measured in the same run.

    python -m bench.cli_startup [REPEATS] [--base SRC]

With `--base SRC` (a `src` directory of another checkout, e.g. `git archive BASE src | tar -x -C /tmp/b`),
every tether row runs a second time with that tree first on PYTHONPATH, in the same rotation: a
before/after comparison measured interleaved on the same machine.

The machine this runs on is usually shared, so wall-clock is noise: every figure here is the CPU time
(user + system) of the process, which other load inflates far less. Rows:
- `python -c pass` (the interpreter's floor);
- `tether --help`;
- `tether exec get_system_info info_type=os` (local mode: no server);
- a Python process that imports `websockets` and does one echo round trip (the device's anchor);
- `tether device` launch -> registered against a real `tether server` on 127.0.0.1: the device's CPU
  (its own and its reaped children's, from /proc/PID/stat, clock-tick resolution) read at the moment its
  "registered as" line arrives; then it is stopped and reaped before the next run.

The short-lived processes are measured with `getrusage(RUSAGE_CHILDREN)` around each (one child at a time;
the server, never reaped until the end, does not count). Each repetition runs every row once, in an order
rotated per repetition (interleaved); each row prints the median CPU ms and the spread (min..max).
Bytecode is cached in a private PYTHONPYCACHEPREFIX (a warm-up run of each fills it), as an installed
package runs.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.fleet_startup import ECHO_CLIENT, PY, TETHER, _env, _Server
from bench.kit.procs.timing import device_registered, echo, interleaved, run_timed


async def _cpu_of_run(argv: list[str], env: dict[str, str]) -> float:
    """CPU seconds (user + system) of one process run to its exit; it must exit 0."""
    return (await run_timed(argv, env))[1]


async def _device_cpu(server: _Server, extra_env: dict[str, str]) -> float:
    """CPU seconds `tether device` spends from spawn to its "registered as" line."""
    return (await device_registered(server, {**_env(server.tmp), **extra_env}))[1]


async def measure_async(repeats: int, base: Path | None = None) -> dict[str, list[float]]:
    """Every row's CPU seconds, `repeats` interleaved runs each after one warm-up (each tether row again
    with `base` first on PYTHONPATH when given), against a real server and echo server it starts and stops."""
    from websockets.asyncio.server import serve

    with tempfile.TemporaryDirectory(prefix="tether-bench-cpu-") as tmp_name:
        tmp = Path(tmp_name)
        env = _env(tmp)
        server = _Server(tmp)
        async with serve(echo, "127.0.0.1", 0, compression=None) as echo_server:
            port = next(iter(echo_server.sockets)).getsockname()[1]
            await server.start()
            try:
                rows: dict[str, Callable[[], Awaitable[float]]] = {
                    "python -c pass": lambda: _cpu_of_run([PY, "-c", "pass"], env),
                    "python + websockets, one echo": lambda: _cpu_of_run(
                        [PY, "-c", ECHO_CLIENT, f"ws://127.0.0.1:{port}"], env),
                }
                trees = {"": {}} if base is None else {"": {}, " [base]": {"PYTHONPATH": str(base)}}
                for label, extra in trees.items():
                    tree_env = {**env, **extra}
                    rows[f"tether --help{label}"] = lambda e=tree_env: _cpu_of_run([*TETHER, "--help"], e)
                    rows[f"tether exec get_system_info (local){label}"] = lambda e=tree_env: _cpu_of_run(
                        [*TETHER, "exec", "get_system_info", "info_type=os"], e)
                    rows[f"tether device launch -> registered{label}"] = lambda x=extra: _device_cpu(server, x)
                samples = await interleaved(rows, repeats)  # its warm-up fills the page cache and the .pyc files
            finally:
                await server.aclose()
    return samples


def measure(repeats: int, base: Path | None = None) -> dict[str, list[float]]:
    """Every row's CPU seconds, `repeats` interleaved runs each (and each tether row again with `base`
    first on PYTHONPATH when given); prints the table."""
    started = time.perf_counter()
    samples = asyncio.run(measure_async(repeats, base))
    floor = statistics.median(samples["python -c pass"])
    print(f"{'row':<47} {'median CPU ms':>14} {'spread ms':>16} {'x python -c pass':>17}")
    for name, values in samples.items():
        ms = [v * 1000 for v in values]
        print(f"{name:<47} {statistics.median(ms):14.0f} {min(ms):7.0f}..{max(ms):<7.0f} "
              f"{statistics.median(values) / floor if floor else float('nan'):16.1f}x")
    print(f"n={repeats} each, {time.perf_counter() - started:.0f} s")
    return samples


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repeats", type=int, nargs="?", default=10)
    parser.add_argument("--base", type=Path, help="another checkout's src directory, measured interleaved")
    args = parser.parse_args()
    measure(args.repeats, args.base.resolve() if args.base else None)
