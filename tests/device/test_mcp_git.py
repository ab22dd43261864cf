"""`mcp-server-git` (PyPI, in the test extra), a server nobody here wrote, loaded from a desktop
client's `mcpServers` file and driven through `tether exec` as a real process: status, log, and its
errors, whose text (`[/x]`, pydantic's `[type=missing ...]`) must print literally, never as markup."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kits.netutil import CLI, tether_env

GIT_SERVER = Path(sys.executable).with_name("mcp-server-git")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if not GIT_SERVER.exists():
        pytest.fail(f"{GIT_SERVER} is missing: pip install -e '.[test]' (it installs mcp-server-git)")
    path = tmp_path / "repo"
    git = ["git", "-C", str(path), "-c", "user.name=Tess Tether", "-c", "user.email=tess@example.invalid"]
    subprocess.run(["git", "init", "-q", str(path)], check=True, timeout=30)
    (path / "notes.txt").write_text("first\n")
    subprocess.run([*git, "add", "notes.txt"], check=True, timeout=30)
    subprocess.run([*git, "commit", "-q", "-m", "add the notes"], check=True, timeout=30)
    (path / "notes.txt").write_text("first\nsecond\n")
    return path


def exec_git(tmp_path: Path, repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "claude_desktop_config.json"  # as a desktop client writes it, its own keys included
    cfg.write_text(json.dumps({"globalShortcut": "Ctrl+Space", "mcpServers": {
        "git": {"command": str(GIT_SERVER), "args": ["--repository", str(repo)]}}}))
    state = tmp_path / "state"
    ran = subprocess.run([*CLI, "exec", "--config", str(cfg), "--state-dir", str(state), *args],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, env=tether_env(state), timeout=120)
    assert "Traceback" not in ran.stderr and "MarkupError" not in ran.stderr, ran.stderr
    return ran


def flat(text: str) -> str:
    """The output with rich's line wrapping undone."""
    return " ".join(text.split())


def test_status_and_log(tmp_path: Path, repo: Path) -> None:
    status = exec_git(tmp_path, repo, "git_status", f"repo_path={repo}")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "Repository status:\n" in status.stdout and "modified:   notes.txt\n" in status.stdout

    ran = exec_git(tmp_path, repo, "git_log", f"repo_path={repo}", "--json")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    result: dict[str, Any] = json.loads(ran.stdout)
    assert result["namespace"] == "git"
    assert "Author: Tess Tether" in result["result"]["text"] and "Message: add the notes" in result["result"]["text"]
    assert [item["type"] for item in result["result"]["content"]] == ["text"]

    diff = exec_git(tmp_path, repo, "git_diff_unstaged", f"repo_path={repo}")
    assert diff.returncode == 0, diff.stdout + diff.stderr
    assert "\n+second\n" in diff.stdout  # a diff printed as text, its lines kept


def test_errors_print_literally(tmp_path: Path, repo: Path) -> None:
    bad = exec_git(tmp_path, repo, "git_show", f"repo_path={repo}", "revision=[/x]")
    assert bad.returncode == 1
    assert "Ref '[/x]' did not resolve to an object" in flat(bad.stdout + bad.stderr)

    missing = exec_git(tmp_path, repo, "git_show", f"repo_path={repo}")
    assert missing.returncode == 1
    assert "revision Field required [type=missing," in flat(missing.stdout + missing.stderr)

    injected = exec_git(tmp_path, repo, "git_show", f"repo_path={repo}", f"revision=--output={tmp_path / 'pwned'}")
    assert injected.returncode == 1 and "cannot start with '-'" in flat(injected.stdout + injected.stderr)
    assert not (tmp_path / "pwned").exists()
