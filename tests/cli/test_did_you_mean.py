"""A mistyped sub-command (issue 32): a usage error (exit 2) naming the nearest commands, whether or not
their modules are imported yet, and no traceback."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.kits.netutil import CLI

ENV = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}


@pytest.mark.parametrize(("typed", "meant"), [("devcies", "'devices'"), ("tsks", "'tasks'"), ("audti", "'audit'"),
                                              ("sesions", "'sessions'"), ("devices pendng", "'pending'")])
def test_a_typo_says_what_was_meant_and_exits_2(typed: str, meant: str) -> None:
    out = subprocess.run([*CLI, *typed.split()], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 2, out.stderr
    said = " ".join(out.stderr.replace("│", " ").split())
    assert f"No such command {typed.split()[-1]!r}. Did you mean {meant}" in said, out.stderr
    assert "Traceback" not in out.stderr


def test_nothing_near_is_still_a_usage_error() -> None:
    out = subprocess.run([*CLI, "zzzzzz"], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 2 and "No such command 'zzzzzz'." in out.stderr and "Did you mean" not in out.stderr


def test_options_and_real_commands_still_resolve() -> None:
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("tether ")
