"""issue 12, CLI conventions: every option and argument has a help text and a label a person can read,
commands come in topic panels, exit codes are the documented ones in every command (an unreachable
server is always 4), a server's refusal speaks CLI ("set TETHER_TOKEN"), ids are never cut."""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer

import tether.cli.commands
from tests.kits import db as dbkit
from tests.kits.netutil import CLI, Proc, free_port, tether_env, wait_for, workspace_policy
from tether.cli.common import COMMAND_PANELS, ExitCode, app

ROOT = Path(__file__).resolve().parents[2]
# typer's own labels: Python annotations in angle brackets, which read as argument names
ANNOTATION_LABEL = re.compile(r"<(?:bool|str|int|float|path|file|dir|datetime|list\[[^>]*\]|\w+ range)>")


def _root_command() -> Any:
    # every module of every family: each attaches its commands
    for module in pkgutil.walk_packages(tether.cli.commands.__path__, "tether.cli.commands."):
        importlib.import_module(module.name)
    return typer.main.get_command(app)


def _walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _walk(sub, (*path, name))


def _cli(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_every_option_and_argument_has_a_help_text() -> None:
    missing = []
    commands = list(_walk(_root_command()))
    assert len(commands) > 30  # the walk reached the sub-groups (tools, token, mcp, server, device, …)
    for path, command in commands:
        ctx = typer.Context(command)
        for param in command.get_params(ctx):
            if not getattr(param, "help", None):
                missing.append(f"tether {' '.join(path)} {param.opts or param.name}")
        if not (command.help or command.short_help):
            missing.append(f"tether {' '.join(path)} (the command itself)")
    assert not missing, "no help text: " + "; ".join(missing)


def test_help_labels_values_for_people_and_flags_not_at_all(tmp_path: Path) -> None:
    env = tether_env(tmp_path)
    paths = [path for path, _ in _walk(_root_command())]
    bad = {}
    for path in paths:
        out = _cli(*path, "--help", env=env)
        assert out.returncode == 0, (path, out.stderr)
        if found := ANNOTATION_LABEL.findall(out.stdout):
            bad[" ".join(path) or "tether"] = found
    assert not bad, f"annotation labels in --help: {bad}"
    run = _cli("run", "--help", env=env).stdout
    assert re.search(r"--plan\s+PATH\s", run) and re.search(r"--server\s+URL\s", run)
    assert re.search(r"--dry-run\s{2,}plan", run)  # a flag: no label between the name and its help
    assert "[REQUEST]" in run  # an argument by its name, as the usage line says it
    serve = _cli("tools", "serve", "--help", env=env).stdout
    assert re.search(r"--port\s+N\s", serve)


def test_root_help_groups_commands_in_topic_panels_in_order(tmp_path: Path) -> None:
    out = _cli("--help", env=tether_env(tmp_path))
    assert out.returncode == 0
    panels = re.findall(r"╭─ ([^─]+?) ─", out.stdout)
    assert panels == ["Options", *(title for title, _ in COMMAND_PANELS)], panels
    assert "╭─ Commands ─" not in out.stdout  # every command is in a topic panel
    listed = re.findall(r"^│ (\w[\w-]*)\s{2,}", out.stdout, re.MULTILINE)
    assert listed == [name for _, names in COMMAND_PANELS for name in names]
    top = set(_root_command().commands)
    assert top == set(listed), top ^ set(listed)
    words = " ".join(re.sub(r"[│╭╰─╮╯]", " ", out.stdout).split())
    assert "Exit codes: 0 done, 1 failed or refused, 2 bad usage" in words and "4 server unreachable" in words


def test_an_unreachable_server_is_exit_4_in_every_command(tmp_path: Path) -> None:
    env = {**tether_env(tmp_path), "TETHER_SERVER": f"http://127.0.0.1:{free_port()}", "TETHER_TOKEN": "x"}
    commands = [("tasks",), ("devices",), ("devices", "pending"), ("audit",), ("log", "abc123"),
                ("cancel", "abc123"), ("answer", "abc123", "yes"), ("approve", "abc123"),
                ("policy", "show", "--device", "d"), ("exec", "shell.run", "cmd=true", "--device", "d"),
                ("tools", "--device", "d"), ("run", "--dry-run", "do a thing"),
                ("run", "do a thing", "--device", "d"), ("undo", "abc123")]
    codes = {}
    for args in commands:
        out = _cli(*args, env=env)
        assert "Traceback" not in out.stderr, (args, out.stderr)
        assert "cannot reach the tether server" in out.stderr, (args, out.stderr)
        assert "TETHER_SERVER" in out.stderr  # says what to change
        codes[" ".join(args)] = out.returncode
    assert set(codes.values()) == {ExitCode.UNREACHABLE}, codes


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, str, dict[str, str]]]:
    db = tmp_path / "server.db"
    secret, reader = dbkit.create_tokens(dbkit.server_db(db), [
        ("api", "admin", ["read", "execute", "approve", "admin"]), ("api", "reader", ["read"])])
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = tether_env(tmp_path / "state")
    proc = Proc(["server", "--port", str(port), *dbkit.server_db_args(db), "--log-level", "warning"],
                tmp_path / "server.log", env)
    try:
        wait_for(lambda: httpx.get(f"{base}/api/v1/health", timeout=5).json()["status"] == "ok", "server health",
                 procs=(proc.popen,))
        yield base, secret, {**env, "TETHER_SERVER": base, "READER": reader}
    finally:
        proc.stop()


def test_a_refusal_says_what_to_do_in_cli_terms(server: tuple[str, str, dict[str, str]]) -> None:
    base, secret, env = server
    raw = httpx.get(f"{base}/api/v1/devices", timeout=10)  # HTTP clients keep the HTTP wording
    assert raw.status_code == 401 and "Authorization: Bearer" in raw.json()["error"]
    for args in (("devices",), ("tasks",), ("audit",), ("run", "--dry-run", "hello"), ("log", "abc123")):
        out = _cli(*args, env=env)
        assert out.returncode == ExitCode.USAGE, (args, out.returncode, out.stderr)
        assert out.stderr.startswith("error: no API token: set TETHER_TOKEN or pass --token"), (args, out.stderr)
        assert "Authorization" not in out.stderr and "Traceback" not in out.stderr
    wrong = _cli("devices", env={**env, "TETHER_TOKEN": "tapi_not_a_real_one"})
    assert wrong.returncode == ExitCode.USAGE and "unknown or revoked" in wrong.stderr
    assert "TETHER_TOKEN" in wrong.stderr and "Authorization" not in wrong.stderr
    ok = _cli("devices", env={**env, "TETHER_TOKEN": secret})
    assert ok.returncode == 0, ok.stderr
    scoped = _cli("cancel", "abc123", env={**env, "TETHER_TOKEN": env["READER"]})
    assert scoped.returncode == ExitCode.FAILED and "lacks the 'execute' scope" in scoped.stderr, scoped.stderr
    assert "tether token create --api NAME --scope execute" in " ".join(scoped.stderr.split())


def test_session_and_task_ids_are_whole_on_a_narrow_terminal(tmp_path: Path) -> None:
    env = {**tether_env(tmp_path / "state"), "COLUMNS": "40"}
    session = "a-long-session-id-0123456789abcdef"
    done = _cli("exec", "--policy", str(workspace_policy(tmp_path)), "write_file", f"file_path={tmp_path / 'x.txt'}",
                "content=x", "--session", session, env=env)  # its directory in /tmp: a write root
    assert done.returncode == 0, done.stdout + done.stderr
    listed = _cli("sessions", env=env)
    assert listed.returncode == 0 and session in listed.stdout, listed.stdout


def test_readme_documents_every_exit_code() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    for code in ExitCode:
        assert re.search(rf"^\| `?{code.value}`? \|", section, re.MULTILINE), f"exit code {code.value} not in README"
