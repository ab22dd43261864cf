"""The commands that use a device state directory but run no command there still take its lock: `tether undo
--local` (it puts files back and writes the undo journal: beside a running device, a restore could be made under
a command changing the same file, or the device's own undo of the session made twice), `tether tools` and
`tether run --dry-run` (their device reads the kept grants and the sandbox probe there, and starts the external
MCP servers). Against a process holding the state directory — a real process with the real lock, as a `tether
device` holds it — each is refused in one line naming it (exit code 2) and changes nothing there.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.kits.netutil import CLI
from tests.kits.state_holder import holder, release

USAGE_EXIT = 2


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A user of its own (home, no tether settings) whose state directory is `tmp_path/state`."""
    home = tmp_path / "home"
    home.mkdir()
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("TETHER_", "OPENAI_", "XDG_")) or k == "TETHER_ALLOW_ROOT"}
    return {**base, "HOME": str(home), "TETHER_STATE_DIR": str(tmp_path / "state")}


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def tether(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)


def refused_line(ran: subprocess.CompletedProcess[str]) -> str:
    assert ran.returncode == USAGE_EXIT, (ran.stdout, ran.stderr)
    assert ran.stdout == "" and "Traceback" not in ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_local_undo_beside_a_running_device_is_refused_and_puts_nothing_back(tmp_path: Path,
                                                                               env: dict[str, str]) -> None:
    from tether.tools.journal import UndoJournal

    state = tmp_path / "state"
    target = tmp_path / "work" / "notes.txt"
    target.parent.mkdir()
    target.write_text("original\n")
    UndoJournal(state).record("s-1", "write", target)  # what a command on this state directory journaled
    target.write_text("changed by the command\n")
    device = holder(state, "tether device")
    try:
        before = files(state)
        line = refused_line(tether(["undo", "s-1", "--local", "--json"], env))
        assert line.startswith(f"error: another tether device (pid {device.pid}) uses the state directory {state} "
                               "and writes its undo journal: stop it before undoing here"), line
        assert "tether undo TASK --server URL" in line  # what it ran for a server is undone through the server
        assert target.read_text() == "changed by the command\n"  # nothing put back
        assert files(state) == before  # no `undone` line, no lock of a session's restore
    finally:
        release(device)
    ran = tether(["undo", "s-1", "--local", "--json"], env)  # the device gone: the restore runs
    assert ran.returncode == 0, ran.stderr
    assert [row["ok"] for row in json.loads(ran.stdout)] == [True]
    assert target.read_text() == "original\n"


def test_tools_and_a_dry_run_beside_a_running_device_are_refused(tmp_path: Path, env: dict[str, str]) -> None:
    state = tmp_path / "state"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"skill": "get_system_info", "args": {}}]))
    device = holder(state, "tether device")
    try:
        before = files(state)
        for args in (["tools"], ["run", "--local", "--plan", str(plan), "--dry-run"]):
            line = refused_line(tether(args, env))
            assert line.startswith(f"error: another tether device (pid {device.pid}) already uses the state "
                                   f"directory {state} ("), (args, line)
            assert files(state) == before, args  # no sandbox probe or anything else written there
        # a state directory of its own (`tether tools --state-dir`): it lists
        ran = tether(["tools", "--json", "--state-dir", str(tmp_path / "own")], env)
        assert ran.returncode == 0, ran.stderr
        assert "get_system_info" in {tool["name"] for tool in json.loads(ran.stdout)}
    finally:
        release(device)
    ran = tether(["run", "--local", "--plan", str(plan), "--dry-run"], env)  # the device gone: it plans
    assert ran.returncode == 0, ran.stderr
    assert "plan (dry run, nothing ran)" in ran.stdout


def test_sessions_only_reads_and_lists_beside_a_running_device(tmp_path: Path, env: dict[str, str]) -> None:
    """`tether sessions` takes no lock: the journal is appended in whole lines, so a look beside a running device
    is safe, and is what a person does before stopping it to undo."""
    from tether.tools.journal import UndoJournal

    state = tmp_path / "state"
    (tmp_path / "notes.txt").write_text("original\n")
    UndoJournal(state).record("s-1", "write", tmp_path / "notes.txt")
    device = holder(state, "tether device")
    try:
        before = files(state)
        ran = tether(["sessions", "--json"], env)
        assert ran.returncode == 0, ran.stderr
        assert [(row["session_id"], row["pending"]) for row in json.loads(ran.stdout)] == [("s-1", 1)]
        assert files(state) == before
    finally:
        release(device)


def test_a_state_directory_held_by_the_demo_is_said_to_be(tmp_path: Path, env: dict[str, str]) -> None:
    state = tmp_path / "state"
    demo = holder(state, "tether demo")  # what `tether demo --local` writes on its lock (cli/demo/tour.py)
    try:
        line = refused_line(tether(["tools"], env))
        assert line.startswith(f"error: another tether demo (pid {demo.pid}) already uses the state directory"), line
    finally:
        release(demo)
