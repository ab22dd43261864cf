"""bench/mcp_stdio.py at its smallest with both its modes: `--rest` (a worker running a tether server and its
device) and `--base` (another checkout's `src`: here this one's), every side measured in turns in one run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIDES = ("anchor: bare mcp SDK, one session", "tether CommandRouter -> StdioServer", "the same from ",
         "REST -> server -> device -> StdioServer", "REST, from ")
RATIOS = ("tether / bare SDK", "--base / bare SDK", "tether / --base", "REST / bare SDK", "REST --base / bare SDK",
          "REST / REST --base")


def test_every_side_and_ratio_is_measured_with_rest_and_base() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.mcp_stdio", "16", "--chunk", "2", "--fresh", "0", "--rest",
                           "--base", str(REPO / "src")], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    for side in SIDES:
        [row] = [line for line in lines if line.startswith(side)]
        figures = re.search(r" p50 +([\d.]+) us .* CPU median +([\d.]+) us .* n=16$", row)
        assert figures is not None and float(figures[1]) > 0 and float(figures[2]) > 0, row
    for label in RATIOS:
        [row] = [line for line in lines if line.startswith(label + " ")]
        figures = re.search(r"wall p50 ([\d.]+)x .* CPU ([\d.]+)x", row)
        assert figures is not None and float(figures[1]) > 0 and float(figures[2]) > 0, row
