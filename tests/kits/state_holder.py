"""Another process holding a device state directory's lock (`tether.device.local.hold_state_dir`) as a given
kind of tether process ("tether device", "tether exec", …) until the test lets it go: the real flock of a real
process, without the cost of starting that process's device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HOLD = """
import sys
from pathlib import Path
from tether.device.local import hold_state_dir
fd = hold_state_dir(Path(sys.argv[1]), sys.argv[2])
print("held", flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""


def holder(state: Path, kind: str) -> subprocess.Popen[str]:
    """Another process holding `state`'s lock as `kind`, until its stdin is closed (`release`)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(state), kind], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def release(proc: subprocess.Popen[str]) -> None:
    """Let `proc` (a `holder`) go: it ends, and its lock with it."""
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
