"""What live processes spend, read from /proc: CPU to the nanosecond over all threads (`cpu_exact_s`), time spent
runnable but waiting for a core (`run_queue_s`), and py-spy's top functions by own time (`profile_device`)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

IDLE_FRAMES = ("EpollSelector.select", "_worker (concurrent/futures/thread.py")  # waiting, not working


def cpu_exact_s(proc: psutil.Process) -> float:
    """CPU seconds of all of `proc`'s threads so far, to the nanosecond (/proc/PID/task/*/schedstat): psutil's
    clock ticks (10 ms) are coarser than a device's CPU over one round."""
    total = 0
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def run_queue_s(procs: list[psutil.Process]) -> float:
    """Seconds `procs` (their main threads) have spent runnable but waiting for a core (/proc/PID/schedstat):
    on a loaded machine, the part of a round trip that is the scheduler's, not anyone's code."""
    total = 0
    for proc in procs:
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{proc.pid}/schedstat").read_text().split()[1])
    return total / 1e9


def profile_device(pid: int, seconds: float, out: Path) -> str:
    """py-spy's top functions (own time) of process `pid` over `seconds`, or why there are none."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        return "py-spy is not installed: no profile"
    done = subprocess.run([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--format", "raw",
                           "--output", str(out), "--rate", "500"], capture_output=True, text=True,
                          timeout=seconds + 60)
    if done.returncode != 0 or not out.exists():
        return f"py-spy failed: {done.stderr[-500:]}"
    own: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if any(idle in frames[-1] for idle in IDLE_FRAMES):
            continue
        total += int(count)
        own[frames[-1]] = own.get(frames[-1], 0) + int(count)
    top = sorted(own.items(), key=lambda kv: -kv[1])[:40]
    return "\n".join(f"{100 * n / max(total, 1):5.1f}%  {frame}" for frame, n in top)
