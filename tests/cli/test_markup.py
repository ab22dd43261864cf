"""Text tether did not write (a tool's error, pydantic's `[type=missing …]`, a path like `[/x]`, a server's
name) is printed as it is by the real `tether` process: never read as rich markup, so never eaten and
never a MarkupError traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ANNOTATED = Path(__file__).parent.parent / "servers" / "annotated.py"


def tether(*args: str, state: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TETHER_STATE_DIR": str(state), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tether.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"mcpServers": {"ann": {"command": sys.executable, "args": [str(ANNOTATED)]}}}))
    return path


def _clean(out: subprocess.CompletedProcess[str]) -> str:
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "MarkupError" not in text, text
    return text


def test_pydantic_error_of_an_external_tool_is_shown_whole(tmp_path, config):
    out = tether("exec", "read_text", "--config", str(config), state=tmp_path / "s", cwd=tmp_path)
    text = _clean(out)
    assert out.returncode == 1, text
    assert "Field required [type=missing, input_value={}, input_type=dict]" in text


def test_a_path_that_looks_like_a_closing_tag_is_printed(tmp_path, config):
    out = tether("exec", "read_text", f"path={tmp_path}/revision=[/x]", "--config", str(config),
                 state=tmp_path / "s", cwd=tmp_path)
    text = _clean(out)
    assert out.returncode == 1 and "revision=[/x]" in text, text
    built_in = tether("exec", "read_file", "file_path=/nonexistent/[/x]", state=tmp_path / "s", cwd=tmp_path)
    text = _clean(built_in)
    assert built_in.returncode == 1 and "/nonexistent/[/x]" in text, text


def test_fail_and_unavailable_server_lines_keep_brackets(tmp_path):
    out = tether("exec", "read_file", "[bold]x[/bold]", state=tmp_path / "s", cwd=tmp_path)
    text = _clean(out)
    assert out.returncode == 2 and "error: argument '[bold]x[/bold]' is not key=value" in out.stderr, text
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"mcpServers": {"[/x]": {"command": str(tmp_path / "no-such-server")}}}))
    listed = tether("tools", "--config", str(broken), state=tmp_path / "s", cwd=tmp_path)
    text = _clean(listed)
    assert listed.returncode == 0 and "server [/x] is unavailable" in text, text
