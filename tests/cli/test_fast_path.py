"""issue 33 item 4: `tether device` and `tether exec` parsed without typer (`tether.cli.fast`). Its table of
options is generated from the typer app and must be current; for the same command lines it gives the
command's function exactly the values typer gives it, and every command line it does not take (help, bad
input, sub-commands) is left to typer, whose usage errors stay the only ones. `tether --help` is drawn from what
typer drew (`tether.cli.fast.help`), the same at every width, with colour, run as `tether` or `python -m`."""

from __future__ import annotations

import functools
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from tests.kits.netutil import tether_env
from tether.cli.commands.fleet.exec_run import run_exec
from tether.cli.commands.fleet.tools import exec_
from tether.cli.commands.setup.device import device
from tether.cli.fast import gen, parse
from tether.cli.fast.spec import COMMANDS

ENV = {"TETHER_SERVER": "http://env:1", "TETHER_TOKEN": "envtok", "TETHER_CA_FILE": ""}

# (command, words after it): command lines the fast path takes
TAKEN = [
    ("exec", ["get_system_info", "info_type=os"]),
    ("exec", ["shell.run", "cmd=ls", "argv:=[\"-l\"]", "--json", "--timeout", "2.5", "-c", "c.yaml"]),
    ("exec", ["--device", "box", "shell.run", "-dother", "cmd=ls", "--session=s1", "--approve", "--raw"]),
    ("exec", ["files.read_file", "--state-dir", "/tmp/s", "--policy=p.yaml", "--type", "action", "path=/x"]),
    ("exec", ["shell.run", "--all", "--require", "tag=a", "--require=gpu", "--max-concurrency", "3", "--", "-x"]),
    ("exec", ["t", "--server", "http://flag:2", "--token", "", "--ca-file", "ca.pem", "--save-dir", "out", "-"]),
    ("exec", ["t", "--always", "program", "--timeout", "10", "--json", "--json", "--session", "--json"]),
    ("exec", ["t", "--allow-root", "--max-concurrency", "1", "--timeout", "0"]),
    ("device", []),
    ("device", ["--server", "ws://a:1", "--server=ws://b:2,ws://c:3", "--name", "n1", "--tag", "x", "--tag=y"]),
    ("device", ["--token-file", "t.txt", "-c", "cfg.yaml", "--policy", "p.yaml", "--state-dir", "s", "--pair"]),
    ("device", ["--ca-file=ca.pem", "--tls-fingerprint", "ab:cd", "--log-level", "debug", "--log-format", "json"]),
    ("device", ["--allow-root", "--token", "refused-later", "--"]),
]

# command lines left to typer: help, unknown or malformed options, missing values or arguments, sub-commands
LEFT = [
    ("exec", []), ("exec", ["-h"]), ("exec", ["t", "--help"]), ("exec", ["t", "--nope"]), ("exec", ["t", "-x"]),
    ("exec", ["t", "--timeout"]), ("exec", ["t", "--timeout", "abc"]),
    ("exec", ["t", "--max-concurrency", "0"]), ("exec", ["t", "--max-concurrency", "2.5"]),
    ("exec", ["t", "--json=yes"]), ("exec", ["t", "-c"]),
    ("exec", ["t", "-1"]), ("exec", ["t", "--jso"]),
    ("device", ["key"]), ("device", ["install", "--name", "x"]), ("device", ["--name", "x", "status"]),
    ("device", ["--help"]), ("device", ["--pair=1"]), ("device", ["--server"]), ("device", ["--bogus"]),
    ("device", ["--", "key"]), ("device", ["-c"]),
]

# values of forms the fast path does not read (typer's pydantic takes them): left to typer, which runs them
LEFT_VALID = [("exec", ["t", "--timeout", "1e3"]), ("exec", ["t", "--timeout", " 1"]),
              ("exec", ["t", "--max-concurrency", "007"]), ("exec", ["t", "-c=x"]),
              ("exec", ["t", "--save-dir="])]  # config '=x', as click reads it

FUNCTIONS = {"exec": exec_, "device": device}


def _typer_kwargs(command: str, words: list[str], env: dict[str, str]) -> tuple[int, dict[str, Any] | None, str]:
    """What typer calls the command's function with for `words` (its exit code, the keyword arguments or None,
    its output): a typer app of one command whose function has the real one's signature and records its call."""
    seen: dict[str, Any] = {}

    @functools.wraps(FUNCTIONS[command])
    def record(**kwargs: Any) -> None:
        kwargs.pop("ctx", None)
        seen.update(kwargs)

    probe = typer.Typer()
    probe.command()(record)
    result = CliRunner().invoke(probe, words, env=env)
    return result.exit_code, (seen if result.exit_code == 0 else None), result.output


def test_the_table_is_what_the_typer_app_generates() -> None:
    assert gen.TARGET.read_text() == gen.render(gen.build()), (
        "tether/cli/fast/spec.py differs from the typer app's options: run python -m tether.cli.fast.gen")


@pytest.mark.parametrize(("command", "words"), TAKEN)
def test_the_fast_path_gives_the_function_what_typer_gives_it(command: str, words: list[str]) -> None:
    for env in ({}, ENV):
        fast = parse(COMMANDS[command], words, env)
        code, expected, output = _typer_kwargs(command, words, {key: env.get(key) for key in ENV})
        assert code == 0, output
        assert fast == expected, (words, env)


@pytest.mark.parametrize(("command", "words"), LEFT)
def test_what_the_fast_path_does_not_take_is_typers_own_help_or_usage_error(command: str, words: list[str]) -> None:
    assert parse(COMMANDS[command], words, ENV) is None
    if "-h" in words or "--help" in words:
        return
    code, _, output = _typer_kwargs(command, words, ENV)
    # a sub-command's name: the probe (the callback alone) has no sub-commands, so it too refuses it
    assert code == 2, output


@pytest.mark.parametrize(("command", "words"), LEFT_VALID)
def test_other_forms_of_a_value_are_left_to_typer(command: str, words: list[str]) -> None:
    assert parse(COMMANDS[command], words, ENV) is None
    assert _typer_kwargs(command, words, ENV)[0] == 0


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`tether ARGS` in a real process, and the modules it imported."""
    out = tmp_path / "modules.json"
    harness = ("import atexit, json, sys\n"
               f"atexit.register(lambda: open({str(out)!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
               "sys.argv = ['tether', *sys.argv[1:]]\nfrom tether.cli import main\nmain()\n")
    env = {**tether_env(tmp_path), "TETHER_ALLOW_ROOT": "1"}
    env.pop("TETHER_DEVICE_TOKEN", None)
    proc = subprocess.run([sys.executable, "-c", harness, *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, set(json.loads(out.read_text()))


def test_tether_device_runs_without_typer_or_click_and_its_errors_are_one_line(tmp_path: Path) -> None:
    proc, modules = _run(tmp_path, "device", "--server", "ws://127.0.0.1:9", "--log-level", "loud")
    assert proc.returncode == 2
    assert "error: --log-level must be debug, info, warning or error, not 'loud'" in proc.stderr.splitlines()
    assert not {m for m in modules if m.split(".")[0] in ("typer", "click")}, "the fast path imported typer"
    proc, _ = _run(tmp_path, "device", "--token", "secret")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --token is not accepted") and "secret" not in (
        proc.stderr)
    proc, modules = _run(tmp_path, "device", "--log-level")  # typer's usage error, as before
    assert proc.returncode == 2 and "requires an argument" in proc.stderr and "typer" in modules


def test_the_exec_body_takes_what_the_typer_command_takes() -> None:
    """The fast path calls `run_exec` with the table's names (generated from `exec_`): the same parameters."""
    assert list(inspect.signature(run_exec).parameters) == list(inspect.signature(exec_).parameters)


def test_tether_exec_runs_a_local_tool_through_the_fast_path(tmp_path: Path) -> None:
    proc, modules = _run(tmp_path, "exec", "get_system_info", "info_type=os", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "success"
    assert "tether.cli.fast.spec" in modules
    assert not {m for m in modules if m.split(".")[0] in ("typer", "click")}, "the fast path imported typer"
    # only the tool set that holds the tool is built; no LLM is looked up without an external MCP server
    unused = ("tether.tools.shell.tool", "tether.tools.files.tool", "tether.tools.browser", "tether.agent")
    assert not {m for m in modules if m.startswith(unused)}
    proc, _ = _run(tmp_path, "exec", "get_system_info", "--timeout", "soon")
    assert proc.returncode == 2 and "Invalid value for '--timeout'" in proc.stderr


def _typer_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`tether ARGS` through the typer app alone, as `tether.cli.main` runs it when the fast path steps aside."""
    harness = ("import logging, sys\nfrom tether.cli.common import app\n"
               "logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s: %(message)s')\n"
               "app(sys.argv[1:], prog_name='tether')\n")
    env = {**tether_env(tmp_path), "TETHER_ALLOW_ROOT": "1"}
    return subprocess.run([sys.executable, "-c", harness, *args], env=env, capture_output=True, text=True, timeout=60)


def _same(text: str) -> str:
    return re.sub(r"(call_id=|cli-|\"call_id\": \")[0-9a-f]+", r"\1X", text)


@pytest.mark.parametrize("words", [
    ["get_system_info", "info_type=os", "--json"], ["get_system_info", "--type", "bogus"],
    ["get_system_info", "bad"], ["nosuch_tool"], ["--type", "action", "get_system_info"],
    ["get_system_info", "info_type=os", "--policy", "/nonexistent/policy.yaml"]])
def test_tether_exec_answers_as_typer_does(tmp_path: Path, words: list[str]) -> None:
    """The same command line through the fast path and through typer alone: the same output, errors and exit
    code (the result's ids aside)."""
    fast, _ = _run(tmp_path, "exec", *words)
    typed = _typer_run(tmp_path, "exec", *words)
    assert (fast.returncode, _same(fast.stderr)) == (typed.returncode, _same(typed.stderr))
    if "--json" in words:
        fast_json, typed_json = json.loads(fast.stdout), json.loads(typed.stdout)
        assert fast_json.keys() == typed_json.keys() and fast_json["status"] == typed_json["status"] == "success"
    else:
        assert _same(fast.stdout) == _same(typed.stdout)
    assert fast.returncode != 0 or "--json" in words


@pytest.mark.parametrize(("program", "env"), [
    ("tether", {"COLUMNS": "20"}), ("tether", {"COLUMNS": "53"}), ("tether", {"COLUMNS": "54"}),
    ("tether", {"COLUMNS": "131"}), ("tether", {"COLUMNS": "90", "FORCE_COLOR": "1"}),
    ("tether", {"TERMINAL_WIDTH": "70", "PY_COLORS": "1"}), ("-m", {"COLUMNS": "40"}), ("-m", {"COLUMNS": "100"})])
def test_the_root_help_is_what_typer_draws(tmp_path: Path, program: str, env: dict[str, str]) -> None:
    """`tether --help` (the fast path) against `tether --help --help` (typer's: the fast path takes `--help`
    alone), in real processes: run by the console script or as `python -m tether.cli`."""
    command = [str(Path(sys.executable).with_name("tether"))] if program == "tether" else [
        sys.executable, "-m", "tether.cli"]
    base = {k: v for k, v in tether_env(tmp_path).items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS")}
    runs = [subprocess.run([*command, *args], env={**base, **env}, capture_output=True, text=True, timeout=60)
            for args in (["--help"], ["--help", "--help"])]
    assert runs[0].returncode == runs[1].returncode == 0, runs[1].stderr
    assert runs[0].stdout == runs[1].stdout
    assert "Usage:" in runs[0].stdout and "device" in runs[0].stdout


def test_the_recorded_help_is_drawn_only_with_the_releases_that_recorded_it() -> None:
    from importlib.metadata import version

    from tether.cli.fast.help import _recorded_with_these_libraries, print_root_help
    from tether.cli.fast.help_data import VERSIONS

    assert not _recorded_with_these_libraries({**VERSIONS, "rich": "13.0.0"})
    assert not _recorded_with_these_libraries({**VERSIONS, "typer": "0.0.1"})
    if {"rich": version("rich"), "typer": version("typer")} != VERSIONS:
        # other releases than those it was recorded with (a new one on PyPI): the fast path must step aside,
        # and typer draws the help (test_the_root_help_is_what_typer_draws then compares typer with typer;
        # `python -m tether.cli.fast.gen` records it again)
        assert not _recorded_with_these_libraries(VERSIONS)
        assert print_root_help() is False
        return
    assert _recorded_with_these_libraries(VERSIONS)
