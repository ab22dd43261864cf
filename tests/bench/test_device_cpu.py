"""bench/device_cpu.py at its smallest: a real device process and the echo anchor measured against the bare
server, and the device's Python path in process; each prints its rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "bench.device_cpu", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_real_device_and_its_python_path_are_measured() -> None:
    out = bench("--devices", "1", "--trips", "30", "--repeats", "1", "--tool", "file_info")
    assert "anchor: websockets client echoing the COMMAND frame" in out and "dev-00 (this tree)" in out
    out = bench("--in-process", "--trips", "200", "--repeats", "1")
    assert "this tree: CPU" in out and "us per command" in out
