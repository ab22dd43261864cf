"""`tether exec` refuses a key given twice (`info_type=os info_type=cpu`) instead of keeping the last one: a
one-line usage error naming the key, exit 2, on the fast path and on typer's (which share the parser)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.kits.netutil import CLI


@pytest.mark.parametrize("more", [[], ["--timeout", "1e3"]], ids=["fast path", "typer's path"])
def test_a_key_given_twice_is_refused(tmp_path: Path, more: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "OPENAI_"))}
    ran = subprocess.run([*CLI, "exec", "get_system_info", "info_type=os", "info_type:=\"cpu\"", *more,
                          "--state-dir", str(tmp_path / "state")], capture_output=True, text=True, timeout=120,
                         env={**env, "TETHER_ALLOW_ROOT": "1", "NO_COLOR": "1"})
    assert ran.returncode == 2, ran.stdout + ran.stderr
    errors = [line for line in ran.stderr.splitlines() if "error" in line.lower()]  # not the root warnings
    assert errors == ["error: argument info_type is given twice: give each key once"], ran.stderr
    assert ran.stdout == ""
