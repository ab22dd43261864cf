"""bench/reconnect_storm.py at its smallest: one real device owing a result rides out a server kill and restart,
and the bench prints its rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_device_riding_out_a_server_restart_is_measured() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.reconnect_storm", "--devices", "1", "--down", "0", "--grace",
                           "1", "--repeats", "1"], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "restart -> all registered" in out and "anchor restart -> /health" in out, out
    assert "failed attempts per device" in out and "peak attempts of the fleet" in out, out
