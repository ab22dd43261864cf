"""The `tether` command as a user runs it: a real process, real files, real exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kits.netutil import workspace_policy


def tether(*args: str, state: Path, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "TETHER_STATE_DIR": str(state), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tether.cli", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


def test_tools_lists_every_namespace_and_type(state):
    out = tether("tools", "--json", state=state)
    assert out.returncode == 0, out.stderr
    tools = json.loads(out.stdout)
    names = {t["name"]: t for t in tools}
    for expected in ("shell.run", "shell_execute", "shell_execute_read", "read_file", "write_file",
                     "delete_file", "move_file", "list_dir", "file_info", "get_system_info",
                     "list_processes", "launch_application", "close_application"):
        assert expected in names, expected
    assert names["shell.run"]["tool_type"] == "action"
    assert names["read_file"]["tool_type"] == "data_collection"
    assert "cmd" in names["shell.run"]["input_schema"]["properties"]
    table = tether("tools", state=state)
    assert table.returncode == 0 and "shell.run" in table.stdout and "namespace" in table.stdout


def test_exec_shell_run_in_home(state, tmp_path):
    out = tether("exec", "shell.run", "cmd=ls", 'argv=["-la"]', "cwd=~", "--json", state=state)
    assert out.returncode == 0, out.stdout + out.stderr
    payload = json.loads(out.stdout)
    assert payload["status"] == "success"
    assert payload["result"]["exitCode"] == 0 and payload["result"]["stdout"]


def test_exec_failure_exits_nonzero_with_reason(state, tmp_path):
    out = tether("exec", "shell.run", "cmd=sudo", 'argv=["id"]', f"cwd={tmp_path}", "--json", state=state)
    assert out.returncode == 1
    payload = json.loads(out.stdout)
    assert payload["status"] == "failure" and "always-denied" in payload["error"]
    unknown = tether("exec", "no_such_tool", state=state)
    assert unknown.returncode == 1 and "unknown tool 'no_such_tool'" in unknown.stdout
    bad = tether("exec", "read_file", "nokey", state=state)
    assert bad.returncode == 2 and "key=value" in bad.stderr


def test_exec_then_undo_restores_files(state, tmp_path):
    target = tmp_path / "doc.txt"
    target.write_bytes(b"original\x00bytes")
    policy = str(workspace_policy(tmp_path))  # the test's directory in /tmp: a write root (not a session's /tmp)
    out = tether("exec", "--policy", policy, "write_file", f"file_path={target}", "content=changed", "mode=overwrite",
                 "--session", "cli-s1", "--json", state=state)
    assert out.returncode == 0, out.stdout
    assert target.read_text() == "changed"
    created = tmp_path / "new.txt"
    assert tether("exec", "--policy", policy, "write_file", f"file_path={created}", "content=x", "--session",
                  "cli-s1", state=state).returncode == 0
    listed = tether("sessions", "--json", state=state)
    assert "cli-s1" in listed.stdout
    undone = tether("undo", "cli-s1", "--json", state=state)
    assert undone.returncode == 0, undone.stderr
    assert target.read_bytes() == b"original\x00bytes"
    assert not created.exists()
    again = tether("undo", "cli-s1", state=state)
    assert again.returncode == 0


def test_config_with_external_server_and_bad_config(state, tmp_path):
    cfg = tmp_path / "servers.json"
    cfg.write_text(json.dumps({"mcpServers": {"time": {"command": sys.executable,
                                                       "args": ["-m", "mcp_server_time"]}}}))
    out = tether("exec", "get_current_time", "timezone=UTC", "--config", str(cfg), "--json", state=state)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["namespace"] == "time"
    broken = tmp_path / "broken.yaml"
    broken.write_text("mcp: {a: {default: {action: [{namespace: x, server_type: stdio}]}}}")
    bad = tether("tools", "--config", str(broken), state=state)
    assert bad.returncode == 2 and "needs a 'command'" in bad.stderr


def test_local_demo_runs_green(state):
    out = tether("demo", "--local", "--state-dir", str(state), state=state, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo finished" in out.stdout
    assert "the task ran, its failed mkdir patched by recovery" in out.stdout
    assert "the file it wrote is gone" in out.stdout
