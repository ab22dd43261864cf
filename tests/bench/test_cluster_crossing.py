"""bench/cluster_crossing.py at its smallest: a private redis-server, two real clustered nodes and a device;
one command at a time to the holder and across, each path's round trip and every process's CPU printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_crossing_and_the_same_command_on_the_holder_are_measured() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.cluster_crossing", "--devices", "1", "--rounds", "1",
                           "--trips", "5"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    ratio = re.search(r"^this: round trip p50 cross ([\d.]+) ms .*, same ([\d.]+) ms .*: cross/same ([\d.]+)x",
                      out, re.M)
    assert ratio is not None and all(float(x) > 0 for x in ratio.groups()), out
    same = re.search(r"CPU per command, same : entry ([\d.]+) ms .*device ([\d.]+) ms .*redis ([\d.]+) ms", out)
    cross = re.search(r"CPU per command, cross: entry ([\d.]+) ms .*holder ([\d.]+) ms .*device ([\d.]+) ms", out)
    assert same is not None and cross is not None, out
    assert float(same[1]) > 0 and float(same[2]) > 0 and float(cross[1]) > 0 and float(cross[2]) > 0, out
    assert "nodes' CPU cross/same: " in out and "load average" in out, out
