"""A file that is not what a command expects is refused naming the file, the line and column and the kind of
problem, never quoting what the file holds: given a settings file with a secret in it, or `/etc/shadow` itself
(which YAML reads as a mapping of its lines), no part of a line comes back through the error — not through
PyYAML's snippet, not through an unknown key, not through a value a setting refused.

Real `tether` processes, each command that reads a user's YAML file, with no server needed (each refuses the
file before it would connect anywhere)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.kits.netutil import CLI

SECRET = "TOPSECRET-7f3a"
BROKEN = f"api_key: sk-live-{SECRET}\n  password: {SECRET}-hunter2\n"  # line 2, column 11: a mapping value here
SHADOW = f"root:$6${SECRET}$salt:19000:0:99999:7:::\nsysuser-b9:*:19000:0:99999:7:::\n"
NOWHERE = ("--server", "http://127.0.0.1:9", "--token", "t")

COMMANDS = {  # what reads the file: its command line, with FILE standing for the file
    "exec --policy": ["exec", "--policy", "FILE", "get_system_info"],
    "policy set --file": ["policy", "set", "--device", "lap", "--file", "FILE", *NOWHERE],
    "device --config": ["device", "--config", "FILE"],
    "run --plan": ["run", "--local", "--plan", "FILE"],
    "edit --file": ["edit", "t1", "--file", "FILE", *NOWHERE],
    "server --config": ["server", "--config", "FILE"],
}


def tether(tmp_path: Path, argv: list[str], file: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TETHER_", "OPENAI_"))}
    ran = subprocess.run([*CLI, *[str(file) if a == "FILE" else a for a in argv]], capture_output=True, text=True,
                         timeout=120, env={**env, "TETHER_ALLOW_ROOT": "1", "NO_COLOR": "1", "COLUMNS": "300",
                                           "TETHER_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path)},
                         stdin=subprocess.DEVNULL)
    assert ran.returncode != 0 and "Traceback" not in ran.stderr, ran.stderr
    assert SECRET not in ran.stdout + ran.stderr, ran.stdout + ran.stderr
    return ran.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_a_broken_yaml_file_is_told_by_line_and_column(tmp_path: Path, command: str) -> None:
    file = tmp_path / "settings.yaml"
    file.write_text(BROKEN)
    said = tether(tmp_path, COMMANDS[command], file)
    assert str(file) in said and "line 2, column 11: mapping values are not allowed here" in said, said


@pytest.mark.parametrize("command", ["exec --policy", "device --config"])  # `policy set`: tests/test_yaml12.py
def test_etc_shadow_as_a_settings_file_shows_none_of_its_lines(tmp_path: Path, command: str) -> None:
    file = tmp_path / "shadow"
    file.write_text(SHADOW)
    said = tether(tmp_path, COMMANDS[command], file)
    assert "(a key that is no name)" in said and "sysuser-b9" not in said, said


def test_a_value_a_setting_refuses_is_not_quoted(tmp_path: Path) -> None:
    file = tmp_path / "policy.yaml"
    file.write_text(f"network: sk-{SECRET}\n")
    said = tether(tmp_path, COMMANDS["exec --policy"], file)
    assert "'network': network is on, off, or" in said and "not a str" in said, said
