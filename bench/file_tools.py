"""Device CPU per call of the file tools' read side: the policy checks against plain Python (issue 33, item 1).

    python -m bench.file_tools [--rounds 15] [--calls 300] [--base SRC]

Each tool is called in-process through its tool set (`files_toolset().call`, what a device runs for a
command), with one default policy (its hidden paths: ~/.ssh, ~/.aws, ...; the device's state directory
and config added as a device adds them) and one context kept across calls, as a device keeps them:
- `file_info` of a small file, `read_file` of it (12 bytes), `list_dir` of a directory of 20 entries.
Anchors, the same operation in plain Python in the same process: `os.stat`; `open` + `read`; `os.listdir`
+ `os.lstat` of each entry.

Figures: CPU time (`time.process_time`) per call over `--calls` calls, median of `--rounds` rounds and
the min..max spread; the rounds of every row are interleaved (each round runs each row once), each row
in its own worker process. `--base SRC` (another checkout's `src`, e.g.
`git archive BASE src | tar -x -C /tmp/b`) adds the same tool rows for that tree, run by a second worker
in the same rounds: a before/after of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import spread

OPS = ("file_info", "read_file", "list_dir")
ANCHORS = {"file_info": "os.stat", "read_file": "open+read", "list_dir": "listdir+lstat"}


def _worker(place: str, calls: int) -> None:
    """Answer each line naming a row with its CPU per call, µs (run in its own process)."""
    from tether.tools.context import ToolContext
    from tether.tools.files.tool import files_toolset
    from tether.tools.policy.model import default_policy

    base = Path(place)
    small, folder = base / "small.txt", base / "folder"
    policy = default_policy()
    state = base / "state"
    secrets = (str(state), "~/.config/tether/device.toml", "~/.config/tether/device.token")
    ctx = ToolContext(policy=policy, temp_dir=str(base), secrets=secrets)
    tools = files_toolset()
    args: dict[str, dict[str, Any]] = {"file_info": {"path": str(small)}, "read_file": {"file_path": str(small)},
                                       "list_dir": {"path": str(folder)}}

    def anchor(op: str) -> None:
        if op == "file_info":
            os.stat(small)
        elif op == "read_file":
            with open(small, "rb") as fh:
                fh.read()
        else:
            for name in os.listdir(folder):
                os.lstat(folder / name)

    async def run(op: str) -> float:
        plain = op.startswith("anchor:")
        name = op.removeprefix("anchor:")
        start = time.process_time()
        for _ in range(calls):
            if plain:
                anchor(name)
            else:
                result = await tools.call(name, args[name], ctx)
                if not result.ok:
                    raise SystemExit(f"{name} failed: {result.error}")
        return (time.process_time() - start) / calls * 1e6

    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        print(json.dumps(loop.run_until_complete(run(line.strip()))), flush=True)


def _start(src: str, place: str, calls: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(Path(__file__).resolve().parents[1])])}
    return subprocess.Popen([sys.executable, "-m", "bench.file_tools", "--worker", place, "--calls", str(calls)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _ask(worker: subprocess.Popen[str], op: str) -> float:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(op + "\n")
    worker.stdin.flush()
    line = worker.stdout.readline()
    if not line:
        raise SystemExit(f"a worker stopped while running {op}")
    return float(json.loads(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--base", help="another checkout's src: its tool rows run in the same rounds")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.calls)
        return
    with tempfile.TemporaryDirectory(prefix="bench-files-") as place:
        Path(place, "small.txt").write_text("hello world\n")
        Path(place, "folder").mkdir()
        for i in range(20):
            Path(place, "folder", f"entry{i:02}.txt").write_text(str(i))
        here = str(Path(__file__).resolve().parents[1] / "src")
        workers = {"tether": _start(here, place, args.calls)}
        if args.base:
            workers["base"] = _start(os.path.abspath(args.base), place, args.calls)
        samples: dict[str, list[float]] = {}
        try:
            for _ in range(args.rounds):
                for op in OPS:
                    samples.setdefault(f"{op}|anchor", []).append(_ask(workers["tether"], f"anchor:{op}"))
                    for label, worker in workers.items():
                        samples.setdefault(f"{op}|{label}", []).append(_ask(worker, op))
        finally:
            for worker in workers.values():
                assert worker.stdin is not None
                worker.stdin.close()
                worker.wait(timeout=30)
        print(f"CPU per call, us: median of {args.rounds} rounds x {args.calls} calls (min..max), interleaved;"
              f" load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        for op in OPS:
            anchor = statistics.median(samples[f"{op}|anchor"])
            print(f"  {op:<10} anchor {ANCHORS[op]:<14} {anchor:8.1f}  ({spread(samples[f'{op}|anchor'])})")
            for label in workers:
                row = samples[f"{op}|{label}"]
                median = statistics.median(row)
                print(f"  {op:<10} {label:<21} {median:8.1f}  ({spread(row)})  {median / anchor:6.1f}x the anchor")


if __name__ == "__main__":
    main()
