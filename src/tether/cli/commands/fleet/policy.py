"""`tether policy show|set|allow|deny|approve --device NAME`: a device's policy, governed from the server.

The server pushes the change to the device over AIP; the device applies it, keeps it across
restarts, and answers its new policy version (or why it refused: `policy_remote: false`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from tether.cli.common import CaOpt, ExitCode, JsonOpt, ServerOpt, TokenOpt, app, console, fail, fail_remote

policy_app = typer.Typer(no_args_is_help=True, help="Show or change a device's policy through the server.")
app.add_typer(policy_app, name="policy")

NameOpt = Annotated[str, typer.Option("--device", "-d", help="the device's name")]
ProgramArg = Annotated[str, typer.Argument(help="a program's basename, e.g. git")]
MAX_POLICY_FILE = 1 << 20


def _remote(server: str | None, token: str | None, ca_file: str | None, call: Any) -> dict[str, Any]:
    from tether.client.rest import RemoteError, RemoteServer

    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            return call(remote)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)


def _print(report: dict[str, Any], as_json: bool, title: str) -> None:
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    from rich.table import Table

    out = console()
    remote = "takes changes from the server" if report["remote_allowed"] else "refuses changes (policy_remote: false)"
    out.print(f"{title}: policy version {report['version']}; the device {remote}", soft_wrap=True)
    policy, sources = report["policy"], report["sources"]
    table = Table(show_header=True)
    for col in ("setting", "value", "from"):
        table.add_column(col)
    for key, value in policy.items():
        if key != "commands":
            table.add_row(key, escape(json.dumps(value)), escape(str(sources.get(key, "-"))))
    out.print(table)
    rules = Table(show_header=True, title="commands (the allowlist)")
    for col in ("program", "rule", "from"):
        rules.add_column(col)
    for name, origin in sources.get("commands", {}).items():
        rule = policy["commands"].get(name)
        shown = "removed" if rule is None else json.dumps({k: v for k, v in rule.items() if v not in (None, False, [])})
        rules.add_row(escape(name), escape(shown), escape(str(origin)))
    out.print(rules)


@policy_app.command("show")
def show(device: NameOpt, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
         as_json: JsonOpt = False) -> None:
    """The device's effective policy and where each value comes from (default, file, remote)."""
    _print(_remote(server, token, ca_file, lambda r: r.policy(device)), as_json, device)


@policy_app.command("set")
def set_(device: NameOpt, file: Annotated[Path, typer.Option("--file", "-f", help="policy YAML: the settings to set")],
         replace: Annotated[bool, typer.Option("--replace", help="drop earlier remote changes first")] = False,
         server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Push settings from a YAML file (commands: {program: rule, or null to remove}) to the device."""
    import yaml

    from tether import yaml12

    try:
        with file.expanduser().open("rb") as handle:
            text = handle.read(MAX_POLICY_FILE + 1)
    except OSError as exc:
        fail(f"{file}: cannot read: {exc.strerror or exc}")
    if len(text) > MAX_POLICY_FILE:
        fail(f"{file}: larger than {MAX_POLICY_FILE} bytes")
    try:
        data = yaml12.safe_load(text) or {}
    except yaml.YAMLError as exc:
        fail(f"{file}: not valid YAML: {yaml12.where_and_why(exc)}")
    if not isinstance(data, dict):
        fail(f"{file}: a policy is a mapping of settings, not {type(data).__name__}")
    report = _remote(server, token, ca_file, lambda r: r.set_policy(device, data, replace=replace))
    _print(report, as_json, f"{device}: applied")


def _program(verb: str, device: str, program: str, server: str | None, token: str | None, ca_file: str | None,
             as_json: bool) -> None:
    report = _remote(server, token, ca_file, lambda r: r.policy_program(device, verb, program))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        console().print(f"{device}: {verb} {program}: applied, policy version {report['version']}", soft_wrap=True,
                        markup=False)


@policy_app.command("allow")
def allow(program: ProgramArg, device: NameOpt, server: ServerOpt = None, token: TokenOpt = None,
          ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Add a program to the device's allowlist."""
    _program("allow", device, program, server, token, ca_file, as_json)


@policy_app.command("deny")
def deny(program: ProgramArg, device: NameOpt, server: ServerOpt = None, token: TokenOpt = None,
         ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Remove a program from the device's allowlist."""
    _program("deny", device, program, server, token, ca_file, as_json)


@policy_app.command("approve")
def approve(program: ProgramArg, device: NameOpt, server: ServerOpt = None, token: TokenOpt = None,
            ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Allow a program on the device, with a person's approval needed on every run."""
    _program("approve", device, program, server, token, ca_file, as_json)
