"""Start-up as issue 33 item 4 counts it, wall and CPU, with bytecode as `PYTHONDONTWRITEBYTECODE=1` leaves it.

    python -m bench.startup [REPEATS] [--no-fresh] [--base SRC]

Rows, each against its anchor measured in the same run:
- `tether --help` against `python -c pass` (goal <= 8x), and against a process importing only typer and
  rich (what the help is drawn with: tether's own share is the difference);
- local `tether exec get_system_info info_type=os` against `python -c pass` (goal <= 0.2 s), and against a
  process importing only the libraries its path is built on (asyncio, psutil, rich's console, pydantic with one
  model, run once each): the floor under it while it uses them;
- `tether device` launch -> its "registered as" line, against a real `tether server` on 127.0.0.1, against a
  Python process that imports websockets and does one echo round trip (goal <= 0.3 s), and against one that
  imports the other projects' modules the device imports before it registers and builds one pydantic model
  (its floor: tether's own share is the difference).

Every process runs with PYTHONDONTWRITEBYTECODE=1, as on a machine that sets it, in two trees:
- `installed`: this checkout's `src` with its bytecode compiled as `scripts/_venv.sh` leaves it (compileall
  skips the files already up to date, so this leaves the tree as the script would);
- `fresh` (unless --no-fresh): a copy of `src` without any `__pycache__`, first on PYTHONPATH: an editable
  install before that script compiled it, where every run compiles tether's modules from source;
- `base` (with `--base SRC`: the `src` directory of another checkout, e.g. `git archive main src | tar -x -C
  /tmp/b`, its bytecode compiled the same way), first on PYTHONPATH: a before/after comparison measured
  interleaved in the same run.
The anchors' own bytecode comes from the interpreter's and the venv's installs either way.

Each repetition runs every row of both trees once, in an order rotated per repetition (interleaved), after
one warm-up run of each. Wall: spawn to exit (or to the "registered as" line); CPU: user + system of the
process (`getrusage` of the reaped child; the device's own from /proc/PID/stat at its line, clock-tick
resolution), which other load on a shared machine inflates far less than wall. Each row prints the median
and the spread (min..max) of both, and the ratio of the medians to its anchor's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

from bench.fleet_startup import ECHO_CLIENT, PY, TETHER, _Server
from bench.kit.procs.timing import Sample, device_registered, echo, interleaved, run_timed

SRC = Path(__file__).resolve().parent.parent / "src"
HELP_DEPS = "import typer, typer.core, rich.console, rich.table, rich.markup"
# what a local `tether exec` cannot do without as built (asyncio, psutil, rich's console, pydantic with one model),
# and nothing of tether: the floor under that row
EXEC_DEPS = ("import asyncio, psutil, rich.console, rich.markup, rich.json\nfrom pydantic import BaseModel\n"
             "class A(BaseModel):\n    x: int\nasync def main():\n    return A(x=1)\nasyncio.run(main())\n"
             "rich.console.Console().print_json('{\"x\": 1}')")
# what `tether device` imports of other projects before it registers, and one pydantic model built: its floor
DEVICE_DEPS = ("import asyncio, logging, ssl, psutil, rich.console, rich.markup, websockets.asyncio.client\n"
               "from cryptography.hazmat.primitives.asymmetric import ed25519\n"
               "from cryptography.hazmat.primitives import serialization\n"
               "import pydantic\nclass M(pydantic.BaseModel):\n"
               "    a: list[str] = pydantic.Field(default_factory=list)\nM(a=['x'])\n")


def _env(state: Path, tree: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TETHER_", "PYTHONPYCACHEPREFIX")) or k in ("TETHER_ALLOW_ROOT", "TETHER_RUN_AS")}
    env.update({"TETHER_STATE_DIR": str(state), "NO_COLOR": "1", "COLUMNS": "120", "PYTHONDONTWRITEBYTECODE": "1"})
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    return env


def compile_tree() -> None:
    """What scripts/_venv.sh does: bytecode for every module of src/tether, those up to date skipped."""
    subprocess.run([PY, "-m", "compileall", "-q", "-j", "0", str(SRC / "tether")], check=True,
                   stdout=subprocess.DEVNULL)


async def measure_async(repeats: int, fresh: bool, base: Path | None = None) -> dict[str, list[Sample]]:
    """Every row's (wall, cpu) samples, `repeats` interleaved runs each after one warm-up, in the
    `installed` tree, (with `fresh`) a bytecode-free copy and (with `base`) another tree's `src`,
    against a real server and echo server it starts and stops."""
    from websockets.asyncio.server import serve

    with tempfile.TemporaryDirectory(prefix="tether-bench-startup-") as tmp_name:
        tmp = Path(tmp_name)
        trees: dict[str, Path | None] = {"installed": None}
        if fresh:
            copy = tmp / "fresh-src"
            shutil.copytree(SRC / "tether", copy / "tether", ignore=shutil.ignore_patterns("__pycache__"))
            trees["fresh"] = copy
        if base is not None:
            subprocess.run([PY, "-m", "compileall", "-q", "-j", "0", str(base / "tether")], check=True,
                           stdout=subprocess.DEVNULL)
            trees["base"] = base
        plain = _env(tmp, None)
        server = _Server(tmp)
        async with serve(echo, "127.0.0.1", 0, compression=None) as echo_server:
            port = next(iter(echo_server.sockets)).getsockname()[1]
            await server.start()
            try:
                rows: dict[str, Callable[[], Awaitable[Sample]]] = {
                    "python -c pass": lambda: run_timed([PY, "-c", "pass"], plain),
                    "python importing typer + rich": lambda: run_timed([PY, "-c", HELP_DEPS], plain),
                    "python + exec's libraries, no tether": lambda: run_timed([PY, "-c", EXEC_DEPS], plain),
                    "python + websockets, one echo": lambda: run_timed(
                        [PY, "-c", ECHO_CLIENT, f"ws://127.0.0.1:{port}"], plain),
                    "python importing the device's libraries": lambda: run_timed([PY, "-c", DEVICE_DEPS], plain),
                }
                for label, tree in trees.items():
                    env = _env(tmp, tree)
                    rows[f"tether --help [{label}]"] = partial(run_timed, [*TETHER, "--help"], env)
                    rows[f"tether exec get_system_info [{label}]"] = partial(
                        run_timed, [*TETHER, "exec", "get_system_info", "info_type=os"], env)
                    rows[f"tether device -> registered [{label}]"] = partial(device_registered, server, env)
                # the warm-up fills the page cache and the device's state directory
                samples = await interleaved(rows, repeats)
            finally:
                await server.aclose()
    return samples


ANCHORS = {"tether --help": ("python -c pass", "<= 8x"), "tether exec": ("python -c pass", "<= 0.2 s"),
           "tether device": ("python + websockets, one echo", "<= 0.3 s")}


def measure(repeats: int, fresh: bool = True, base: Path | None = None) -> dict[str, list[Sample]]:
    """Every row's (wall, cpu) samples, `repeats` interleaved runs each (each tether row also with `base`, a
    `src` directory, first on PYTHONPATH when given); prints the table."""
    compile_tree()
    started = time.perf_counter()
    samples = asyncio.run(measure_async(repeats, fresh, base))
    med = {name: (statistics.median(w for w, _ in s), statistics.median(c for _, c in s))
           for name, s in samples.items()}
    print(f"{'row':<44} {'wall ms':>8} {'spread':>13} {'cpu ms':>7} {'spread':>13}  ratio to anchor (wall / cpu)")
    for name, values in samples.items():
        walls = [w * 1000 for w, _ in values]
        cpus = [c * 1000 for _, c in values]
        anchor = next((a for prefix, a in ANCHORS.items() if name.startswith(prefix)), None)
        ratio = ""
        if anchor is not None:
            aw, ac = med[anchor[0]]
            ratio = (f"{med[name][0] / aw:6.1f}x / {med[name][1] / ac:5.1f}x  {anchor[0]}; "
                     f"goal {anchor[1]}")
            if name.startswith("tether --help"):
                hw, hc = med["python importing typer + rich"]
                ratio += f"; {med[name][0] / hw:.2f}x / {med[name][1] / hc:.2f}x typer + rich"
            if name.startswith("tether exec"):
                lw, lc = med["python + exec's libraries, no tether"]
                ratio += f"; {med[name][0] / lw:.2f}x / {med[name][1] / lc:.2f}x its libraries"
            if name.startswith("tether device"):
                lw, lc = med["python importing the device's libraries"]
                ratio += f"; {med[name][0] / lw:.2f}x / {med[name][1] / lc:.2f}x its libraries"
        print(f"{name:<44} {statistics.median(walls):8.0f} {min(walls):6.0f}..{max(walls):<6.0f} "
              f"{statistics.median(cpus):7.0f} {min(cpus):6.0f}..{max(cpus):<6.0f}  {ratio}")
    load = os.getloadavg()[0]
    print(f"n={repeats} each, interleaved; {time.perf_counter() - started:.0f} s; load average {load:.1f} "
          f"on {os.cpu_count()} cores")
    return samples


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repeats", type=int, nargs="?", default=10)
    parser.add_argument("--no-fresh", action="store_true", help="only the tree with its bytecode compiled")
    parser.add_argument("--base", type=Path, help="another checkout's src directory, measured interleaved")
    args = parser.parse_args()
    measure(args.repeats, not args.no_fresh, args.base.resolve() if args.base else None)
