"""The CLI in an 80-column terminal (issue 32): each list command's table keeps its key columns whole
(columns dropped by priority, `-o wide` for all of them), and every command's help shows every option name
uncut. The commands run in-process (typer's CliRunner, COLUMNS=80); the server's answers are stubbed
where a command asks one."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from tether.cli.common import app

WIDTH = 80
ENV = {"COLUMNS": str(WIDTH), "NO_COLOR": "1", "TERM": "dumb", "TETHER_SERVER": "http://127.0.0.1:9",
       "TETHER_TOKEN": "tapi_x"}
NOW = time.time()
DEVICES = [{"name": f"laptop-{n}-workstation", "platform": "linux", "status": "online", "last_seen": NOW - 3,
            "load": 0.25, "running": 1, "queued": 0, "sandbox": "bubblewrap+landlock", "tags": ["lab", "office"],
            "capabilities": ["shell", "files", "browser", "desktop", "system", "mcp"], "gpu": True}
           for n in range(3)]
PENDING = [{"code": "ABCD-EFGH", "fingerprint": "0123456789abcdef0123", "requested_name": "build-server-01",
            "platform": "linux", "address": "192.168.100.200", "expires_at": NOW + 300,
            "collision": "a device named build-server-01 exists"}]
TASKS = [{"id": "0123456789abcdef0123", "state": "waiting_for_user", "device": "laptop-0-workstation",
          "requested_by": "api:continuous-integration",
          "request": "free some disk space on the build machine and tell me what was removed",
          "updated_at": "2026-11-27T05:00:00.000"}]
SESSIONS = [{"session_id": "s-0123456789abcdef01234567", "entries": 12, "pending": 10, "restored": 2,
             "first_at": "2026-11-27T05:00:00+00:00", "last_at": "2026-11-27T05:10:00+00:00"}]


def run(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, list(args), env={**ENV, **(env or {})}, catch_exceptions=False)


def rows_of(out: str) -> list[list[str]]:
    """The table's body rows, as cells (a table's lines start with │)."""
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()
            if line.startswith("│")]


def header_of(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("┃"))
    return [c.strip() for c in line.strip().strip("┃").split("┃")]


def check_fits(out: str, keys: dict[str, list[str]]) -> list[str]:
    """Every line fits WIDTH, nothing is cut with …, and each key column shows each value whole."""
    assert all(len(line) <= WIDTH for line in out.splitlines()), out
    assert "…" not in out, out
    header = header_of(out)
    body = rows_of(out)
    for column, values in keys.items():
        assert column in header, (column, out)
        shown = [row[header.index(column)] for row in body if row[header.index(column)]]
        assert shown == values, (column, shown, out)
    return header


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.client.rest import RemoteServer

    monkeypatch.setattr(RemoteServer, "devices", lambda self: DEVICES)
    monkeypatch.setattr(RemoteServer, "pairing_requests", lambda self: PENDING)
    monkeypatch.setattr(RemoteServer, "tasks", lambda self, limit, state: TASKS)


def test_devices_fit_and_wide_shows_every_column(stubbed: None) -> None:
    out = run("devices")
    assert out.exit_code == 0, out.output
    header = check_fits(out.output, {"name": [d["name"] for d in DEVICES], "status": ["online"] * 3,
                                     "platform": ["linux"] * 3})
    assert "capabilities" not in header and "-o wide" in out.output
    wide = run("devices", "-o", "wide")
    assert header_of(wide.output)[-1] == "capabilities" and "…" not in wide.output
    assert "shell, files, browser, desktop, system, mcp gpu" in wide.output
    assert json.loads(run("devices", "-o", "json").output) == DEVICES == json.loads(run("devices", "--json").output)


def test_pending_requests_fit(stubbed: None) -> None:
    out = run("devices", "pending")
    assert out.exit_code == 0, out.output
    check_fits(out.output, {"code": ["ABCD-EFGH"], "fingerprint": ["0123456789abcdef"]})
    assert "build-server-01" in out.output


def test_tasks_fit(stubbed: None) -> None:
    out = run("tasks")
    assert out.exit_code == 0, out.output
    check_fits(out.output, {"id": ["0123456789ab"], "state": ["waiting_for_user"]})
    wide = run("tasks", "-o", "wide")
    assert header_of(wide.output) == ["id", "state", "device", "by", "request", "updated"]


def test_sessions_fit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tether.tools.journal import UndoJournal

    monkeypatch.setattr(UndoJournal, "sessions", lambda self: SESSIONS)
    out = run("sessions", "--state-dir", str(tmp_path))
    assert out.exit_code == 0, out.output
    header = check_fits(out.output, {"session_id": [SESSIONS[0]["session_id"]]})
    assert len(header) < len(SESSIONS[0])  # some columns dropped at 80
    assert header_of(run("sessions", "--state-dir", str(tmp_path), "-o", "wide").output) == list(SESSIONS[0])


def test_tokens_fit(tmp_path: Path) -> None:
    from tests.kits import db as dbkit
    from tether.server.store import Store

    db = tmp_path / "server.db"
    store = Store(dbkit.server_db(db))
    names = ["continuous-integration-runner", "laptop-0-workstation"]
    ids = [store.tokens.create("api", names[0], ["read", "execute", "approve", "admin"])[0].id,
           store.tokens.create("device", names[1])[0].id]
    store.close()
    out = run("token", "list", "--db", str(db))
    assert out.exit_code == 0, out.output
    check_fits(out.output, {"name": names, "id": [str(i) for i in ids]})
    assert len(header_of(run("token", "list", "--db", str(db), "-o", "wide").output)) == 8


def test_a_bad_output_is_a_usage_error(stubbed: None) -> None:
    out = run("devices", "-o", "yaml")
    assert out.exit_code == 2 and "wide or json" in out.output


def every_command() -> list[tuple[str, ...]]:
    """Each command path of the CLI (`server`, `server install`, `devices pending`, …), all modules loaded."""
    import typer

    paths: list[tuple[str, ...]] = []

    def walk(command: Any, ctx: Any, path: tuple[str, ...]) -> None:
        paths.append(path)
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, sub.context_class(sub, parent=ctx, info_name=name), (*path, name))

    root = typer.main.get_command(app)
    walk(root, root.context_class(root), ())
    return paths


def test_every_help_fits_80_columns_with_every_option_name_whole() -> None:
    from tether.cli.lazy import COMMANDS

    paths = every_command()
    assert {p[0] for p in paths if p} >= set(COMMANDS)
    for path in paths:
        out = run(*path, "--help")
        assert out.exit_code == 0, (path, out.output)
        lines = out.output.splitlines()
        assert all(len(line) <= WIDTH for line in lines), (path, out.output)
        command = app_command(path)
        for param in command.params:
            for name in getattr(param, "opts", []):
                if name.startswith("-") and not getattr(param, "hidden", False):
                    assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", out.output), (path, name, out.output)
        assert "…" not in "\n".join(line for line in lines if line.lstrip("│ ").startswith("-")), (path, out.output)


def app_command(path: tuple[str, ...]) -> Any:
    import typer

    command: Any = typer.main.get_command(app)
    ctx = command.context_class(command)
    for name in path:
        command = command.get_command(ctx, name)
        ctx = command.context_class(command, parent=ctx, info_name=name)
    return command


def test_an_error_naming_a_long_path_keeps_it_on_one_line(tmp_path: Path) -> None:
    """An error is one line however narrow the terminal: a path (or URL) in it is never folded mid-name, so
    it can be copied whole (`fail`, through `say`'s soft wrap)."""
    missing = tmp_path.joinpath(*["a-rather-long-directory-name"] * 6, "policy.yaml")
    result = run("policy", "set", "-d", "laptop", "-f", str(missing), env={"COLUMNS": "40"})
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: {missing}: cannot read: No such file or directory"], result.stderr
