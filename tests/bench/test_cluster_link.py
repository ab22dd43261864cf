"""bench/cluster_link.py at its smallest: two real `Links` over uvicorn, the WebSocket echo and the TCP floor,
each pair's CPU per round trip and the ratios to the anchor printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_link_and_its_floors_are_measured() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.cluster_link", "--rounds", "1", "--trips", "5"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for name in ("anchor", "tcp", "link"):
        row = re.search(rf"^\s*{name}: CPU per round trip ([\d.]+) us", out, re.M)
        assert row is not None and float(row[1]) > 0, out
    assert re.search(r"^link / anchor: [\d.]+x", out, re.M) and "load average" in out, out
