"""issue 12: `tether audit` and GET /api/v1/audit's filters and cursor (a real server process, real CLI
sub-processes), and the CLI's conventions: --version, -h, shell completion, a LICENSE."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.kits.netutil import CLI, Proc, free_port, tether_env, wait_for
from tether.server.store import Store

ROOT = Path(__file__).resolve().parents[2]
TASK = "abcdef1234567890"


class AuditServer:
    """A `tether server` whose audit log holds known rows: alice's own commands on laptop, a task
    bob started on phone, the undo of that task, and a filler row per minute for paging."""

    def __init__(self, tmp: Path) -> None:
        self.db = tmp / "server.db"
        self.env = tether_env(tmp / "state")
        store = Store(self.db)
        _, self.token = store.tokens.create("api", "admin", ["read", "execute", "approve", "admin"])
        store.audit.record("api:alice", "laptop", "c1", "shell.run", {"command": ["ls"]}, "success", None)
        store.audit.record(f"task:{TASK[:12]} for api:bob", "phone", "c2", "files.read_file", {}, "success", None)
        store.audit.record(f"undo:{TASK[:12]} by api:bob", "phone", "c3", "undo", {}, "success", None)
        store.audit.record("api:al_ce", "laptop", "c4", "shell.run", {}, "failure", "boom")  # '_' is not a wildcard
        for i in range(10):
            store.audit.record("api:filler", "laptop", f"f{i}", "shell.run", {}, "success", None)
        store.close()
        with sqlite3.connect(self.db) as conn:  # known times: row id N was written at 1000 + 60 N
            conn.execute("UPDATE audit SET at = 1000 + 60 * id")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=f"{self.base}/api/v1", timeout=30,
                                 headers={"Authorization": f"Bearer {self.token}"})
        self.proc = Proc(["server", "--port", str(self.port), "--db", str(self.db), "--log-level", "warning"],
                         tmp / "server.log", self.env)
        wait_for(lambda: self.http.get("/health").json()["status"] == "ok", "server health",
                 procs=(self.proc.popen,))

    def rows(self, **params: object) -> dict:
        answer = self.http.get("/audit", params=params)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def cli(self, *args: str, token: bool = True) -> subprocess.CompletedProcess:
        env = {**self.env, "TETHER_SERVER": self.base}
        if token:
            env["TETHER_TOKEN"] = self.token
        return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AuditServer]:
    srv = AuditServer(tmp_path)
    yield srv
    srv.http.close()
    srv.proc.stop()


def calls(rows: list[dict]) -> list[str]:
    return [r["call_id"] for r in rows]


def test_audit_endpoint_filters_server_side(server: AuditServer) -> None:
    assert calls(server.rows(device="phone")["rows"]) == ["c3", "c2"]
    assert calls(server.rows(task=TASK)["rows"]) == ["c3", "c2"]  # a full id finds its 12-char record
    assert calls(server.rows(task=TASK[:6])["rows"]) == ["c3", "c2"]
    assert calls(server.rows(token="bob")["rows"]) == ["c3", "c2"]  # through the task and the undo it started
    assert calls(server.rows(token="alice")["rows"]) == ["c1"]
    assert calls(server.rows(token="al_ce")["rows"]) == ["c4"]
    assert calls(server.rows(token="al%")["rows"]) == []
    assert calls(server.rows(since=1000 + 60 * 2, until=1000 + 60 * 4)["rows"]) == ["c3", "c2"]
    assert calls(server.rows(device="laptop", since=1000 + 60 * 4, limit=1)["rows"]) == ["f9"]
    assert server.rows(task="nosuchtask") == {"rows": [], "next": None}


def test_audit_endpoint_pages_with_a_cursor(server: AuditServer) -> None:
    everything = server.rows(limit=500)
    assert everything["next"] is None and len(everything["rows"]) == 14
    seen: list[dict] = []
    before = None
    while True:
        page = server.rows(limit=3, **({"before": before} if before else {}))
        seen += page["rows"]
        before = page["next"]
        if before is None:
            break
        assert before == page["rows"][-1]["id"]
    assert seen == everything["rows"]  # each row once, newest first
    assert len(server.rows(limit=10_000)["rows"]) == 14  # capped at 500, not refused
    bad = server.http.get("/audit", params={"since": "yesterday"})
    assert bad.status_code == 422 and "error" in bad.json()


def test_tether_audit_command(server: AuditServer) -> None:
    done = server.cli("audit", "--json", "--by-token", "bob")
    assert done.returncode == 0, done.stderr
    assert calls(json.loads(done.stdout)) == ["c3", "c2"]
    done = server.cli("audit", "--json", "--device", "laptop", "--limit", "5")
    assert calls(json.loads(done.stdout)) == ["f9", "f8", "f7", "f6", "f5"]
    done = server.cli("audit", "--json", "--task", TASK[:8], "--since", "1970-01-01T00:00:00+00:00",
                      "--until", str(1000 + 60 * 3))
    assert calls(json.loads(done.stdout)) == ["c2"]
    table = server.cli("audit", "--device", "phone")
    assert table.returncode == 0 and f"task:{TASK[:12]} for api:bob" in table.stdout
    assert "2 audit rows" in table.stdout


def test_tether_audit_errors_are_one_line(server: AuditServer, tmp_path: Path) -> None:
    bad = server.cli("audit", "--since", "last tuesday")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --since 'last tuesday'")
    assert "Traceback" not in bad.stderr
    anonymous = server.cli("audit", token=False)
    assert anonymous.returncode != 0 and anonymous.stderr.startswith("error:") and "Traceback" not in anonymous.stderr
    gone = subprocess.run([*CLI, "audit", "--server", f"http://127.0.0.1:{free_port()}", "--token", "x"],
                          env=tether_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert gone.returncode == 4 and gone.stderr.startswith("error: cannot reach the tether server")  # ExitCode


def run_cli(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=tether_env(tmp), capture_output=True, text=True, timeout=60)


def test_version_help_and_completion(tmp_path: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done = run_cli("--version", tmp=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"tether {version}"
    for args in (("-h",), ("audit", "-h"), ("run", "-h"), ("token", "create", "-h"), ("devices", "-h")):
        done = run_cli(*args, tmp=tmp_path)
        assert done.returncode == 0 and "Usage:" in done.stdout and "Options" in done.stdout, (args, done.stderr)
    assert "--install-completion" in run_cli("-h", tmp=tmp_path).stdout
    # typer detects the shell from the process tree (shellingham) and ignores "bash" unless detection is off: with
    # it off the shell is the argument, so the test does not depend on a shell being among its ancestors
    script = subprocess.run([*CLI, "--show-completion", "bash"], capture_output=True, text=True, timeout=60,
                            env={**tether_env(tmp_path), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert script.returncode == 0 and "_completion()" in script.stdout and "complete " in script.stdout


def test_license_matches_pyproject() -> None:
    license_field = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]["text"]
    text = (ROOT / "LICENSE").read_text()
    assert license_field == "MIT" and text.startswith("MIT License")


def test_readme_python_blocks_compile() -> None:
    """A top-level `async with` is a SyntaxError in a script: the README's snippets must run as written."""
    text = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert blocks
    for block in blocks:
        compile(block, "README.md", "exec")


def test_devices_shows_tags_and_sandbox(server: AuditServer, tmp_path: Path) -> None:
    store = Store(server.db)
    _, device_token = store.tokens.create("device", "tagged", [])
    store.close()
    device = Proc(["device", "--server", f"ws://127.0.0.1:{server.port}", "--name", "tagged", "--tag", "lab",
                   "--tag", "gpu-box", "--state-dir", str(tmp_path / "dev")], tmp_path / "device.log",
                  {**server.env, "TETHER_DEVICE_TOKEN": device_token})
    try:
        wait_for(lambda: server.http.get("/devices/tagged").json()["status"] == "online", "device online",
                 procs=(device.popen,))
        table = server.cli("devices")
        assert table.returncode == 0, table.stderr
        header = next(line for line in table.stdout.splitlines() if "name" in line and "sandbox" in line)
        assert "tags" in header
        row = next(line for line in table.stdout.splitlines() if "tagged" in line)
        assert "lab, gpu-box" in row
    finally:
        device.stop()


def test_readme_exec_examples_run_as_written(tmp_path: Path) -> None:
    """The README's write-then-read pair runs as written under the default policy (it read /etc/hostname,
    outside the default read roots, and was denied); the write is undone afterwards. The README's file,
    /tmp/x.txt, becomes one of this test's own directly in /tmp (the same roots decide): two test processes
    on one machine (xdist workers, two CI passes) never write the same file."""
    import shlex

    lines = [line.split("#", 1)[0] for line in (ROOT / "README.md").read_text().splitlines()]
    write = next(line for line in lines if line.startswith("tether exec write_file file_path=/tmp/x.txt content=hello"))
    read = next(line for line in lines if line.startswith("tether exec read_file file_path=/tmp/x.txt "))
    session = f"readme-{tmp_path.name}"
    own = f"/tmp/tether-readme-{uuid.uuid4().hex}.txt"

    def ours(line: str) -> list[str]:
        return [session if a == "s1" else a.replace("=/tmp/x.txt", f"={own}") for a in shlex.split(line)[1:]]

    try:
        done = run_cli(*ours(write), tmp=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        shown = run_cli(*ours(read), tmp=tmp_path)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert json.loads(shown.stdout)["status"] == "success" and "hello" in shown.stdout
    finally:
        run_cli("undo", session, tmp=tmp_path)
        Path(own).unlink(missing_ok=True)
