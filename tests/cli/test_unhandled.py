"""No Python traceback reaches a CLI user: an exception no command caught (a bug in tether) is said in one line,
with its terminal control characters shown as escapes, and exit code 1; TETHER_DEBUG=1 shows the traceback.

A real `tether` process whose `exec` body is made to fail the way a bug would, through both of the CLI's paths
(its fast path and typer's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FAILING = """
import sys
import tether.cli.commands.fleet.exec_run as body

def broken(*args, **kwargs):
    raise RuntimeError("boom \\x1b[2J in the body")

body.run_exec = broken
if sys.argv[1] == "typer":  # the fast path steps aside, as it does for a command line it does not parse
    import tether.cli.fast
    tether.cli.fast.run_fast = lambda argv: None
sys.argv = ["tether", *sys.argv[2:]]
from tether.cli import main
main()
"""


def run(*args: str, debug: bool = False, typer: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TETHER_DEBUG"}
    if debug:
        env["TETHER_DEBUG"] = "1"
    return subprocess.run([sys.executable, "-c", FAILING, "typer" if typer else "fast", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("typer", [False, True], ids=["fast path", "typer"])
def test_a_bug_is_one_line_and_exit_1(typer: bool) -> None:
    ran = run("exec", "get_system_info", typer=typer)
    lines = [line for line in ran.stderr.splitlines() if line.strip() and not line.startswith("warning:")]
    assert ran.returncode == 1, ran.stderr
    assert "Traceback" not in ran.stderr and "\x1b" not in ran.stderr, ran.stderr
    assert lines == ["error: tether stopped on an unexpected error (RuntimeError: boom \\x1b[2J in the body); this "
                     "is a bug in tether: run the command again with TETHER_DEBUG=1 to see where it happened, and "
                     "report it"], ran.stderr


def test_tether_debug_shows_the_traceback() -> None:
    ran = run("exec", "get_system_info", debug=True)
    assert ran.returncode == 1 and "Traceback" in ran.stderr and "RuntimeError: boom" in ran.stderr, ran.stderr
