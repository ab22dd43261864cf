"""`tether device|server install|uninstall|status`: run tether under systemd.

The unit runs this very interpreter (`python -m tether.cli …`), so it keeps working whatever
PATH the service manager gives it, and carries the options given after `--` as they are. It never
carries a secret: a token stays in its file (`--token-file`, or what pairing stored in the state
directory), since unit files are world-readable and shown by `systemctl cat`. Without systemd the
command says so and prints the unit, to be used on a machine that has it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from tether.cli.common import console, device_app, fail, server_app

Kind = str  # "device" or "server"
_PASS = {"allow_extra_args": True, "ignore_unknown_options": True}
UserOpt = Annotated[bool, typer.Option("--user", help="a user unit (~/.config/systemd/user): the default")]
SystemOpt = Annotated[bool, typer.Option("--system", help="a system unit (/etc/systemd/system; needs root)")]
PrintOpt = Annotated[bool, typer.Option("--print", help="print the unit instead of installing it")]
UnitOpt = Annotated[str | None, typer.Option("--unit", help="unit name (default tether-device / tether-server)")]


def unit_name(kind: Kind, name: str | None) -> str:
    base = name or f"tether-{kind}"
    return base if base.endswith(".service") else base + ".service"


def _quote(arg: str) -> str:
    """One ExecStart word: systemd splits on spaces, honours C-style quotes and expands % specifiers."""
    text = arg.replace("%", "%%")
    if text and all(c.isalnum() or c in "-_./:=@+,~" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(kind: Kind, args: list[str], system: bool, workdir: Path | None = None) -> str:
    """The unit file for `tether KIND ARGS…`: restarted always, after the network is up, in `workdir` (default:
    the current directory, absolute). A bad configuration (exit code 2) is not restarted: it would fail the same
    way every few seconds; five quick failures in a minute stop the restarts too."""
    command = [sys.executable, "-m", "tether.cli", kind, *args]
    what = "a device connected to a tether server" if kind == "device" else "the tether agent server"
    lines = [
        "[Unit]",
        f"Description=tether {kind}: {what}",
        "After=network-online.target",
        "Wants=network-online.target",
        "StartLimitIntervalSec=60",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_quote(a) for a in command),
        "WorkingDirectory=" + _quote(str((workdir or Path.cwd()).resolve())),
        "Restart=always",
        "RestartSec=2",
        "RestartPreventExitStatus=2",
        "Environment=PYTHONUNBUFFERED=1",
    ]
    state = os.environ.get("TETHER_STATE_DIR")
    if state:
        lines.append("Environment=" + _quote(f"TETHER_STATE_DIR={state}"))
    lines += ["", "[Install]", f"WantedBy={'multi-user.target' if system else 'default.target'}", ""]
    return "\n".join(lines)


_STR_PATHS = {"--ca-file", "--db"}  # path options typed str (a --db may also be a postgresql:// URL)


def checked_args(kind: Kind, args: list[str]) -> list[str]:
    """`args` checked as `tether KIND` would parse them — an unknown option (a typo such as `--sever`) or a
    bad value is refused (exit 2) with the nearest option names — and every path given in them made
    absolute (a service does not start where `install` ran)."""
    import difflib

    import typer.main

    group = typer.main.get_command(device_app if kind == "device" else server_app)
    try:
        group.make_context(f"tether {kind}", list(args), resilient_parsing=False)
    except typer.Exit:  # an eager option (--help) did its job and stopped
        raise
    except Exception as exc:  # click's usage errors (NoSuchOption, BadParameter, …): never a unit with them
        name = getattr(exc, "option_name", None)
        if name and hasattr(exc, "possibilities"):
            known = [o for p in group.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]
            near = difflib.get_close_matches(name, known, n=2)
            fail(f"tether {kind} has no option {name}" + (f"; did you mean {' or '.join(near)}?" if near else "")
                 + f" (see tether {kind} --help); nothing was written")
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        fail(f"tether {kind} {' '.join(args)}: {message}; nothing was written")
    paths = {o for p in group.params for o in p.opts if o.startswith("--")
             and (getattr(getattr(p, "type_descriptor", None), "annotation", None) is Path or o in _STR_PATHS)}
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        option, eq, value = arg.partition("=")
        if option in paths and eq:
            out.append(f"{option}={_absolute(value)}")
        elif arg in paths and i + 1 < len(args):
            out += [arg, _absolute(args[i + 1])]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def _absolute(value: str) -> str:
    if "://" in value or not value:  # a database URL
        return value
    return str(Path(value).expanduser().absolute())


def _check_args(kind: Kind, args: list[str], token_in_env: bool) -> None:
    for arg in args:
        if arg == "--token" or arg.startswith("--token="):
            fail("a token never goes into a unit file (anyone can read it with 'systemctl cat'): use "
                 "--token-file PATH, or pair first (tether device --server URL --pair)")
    if kind == "device" and token_in_env and "--token-file" not in args:
        fail("TETHER_DEVICE_TOKEN is set, but a service would not have it and a unit file must not hold it: "
             "put the token in a file (chmod 600) and pass --token-file PATH after '--'")


def unit_dir(system: bool) -> Path:
    if system:
        return Path("/etc/systemd/system")
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user"


def systemd_problem(system: bool) -> str | None:
    """Why systemctl cannot be used here, or None."""
    if shutil.which("systemctl") is None:
        return "this machine has no systemd (no systemctl)"
    if not Path("/run/systemd/system").is_dir():
        return "systemd is not running on this machine (it is not the init system here, e.g. in a container)"
    if system and os.geteuid() != 0:
        return "a system unit needs root: run it with sudo, or use --user"
    if not system and not os.environ.get("XDG_RUNTIME_DIR"):
        return "no user service manager in this session (XDG_RUNTIME_DIR is unset): use --system, or log in"
    return None


def _systemctl(system: bool, *args: str) -> subprocess.CompletedProcess[str]:
    argv = ["systemctl", *([] if system else ["--user"]), *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        fail(f"{shlex.join(argv)} failed: {exc}")


def _install(kind: Kind, ctx: typer.Context, user: bool, system: bool, print_only: bool, unit: str | None) -> None:
    if user and system:
        fail("choose --user or --system, not both")
    args = list(ctx.args)
    _check_args(kind, args, bool(ctx.meta.get("tether.device_token_in_env")))
    text = render_unit(kind, checked_args(kind, args), system)
    if print_only:
        typer.echo(text, nl=False)
        return
    problem = systemd_problem(system)
    if problem:
        console(err=True).print(f"cannot install: {problem}. The unit to use on a machine with systemd "
                                f"({unit_dir(system) / unit_name(kind, unit)}):", soft_wrap=True, markup=False)
        typer.echo(text, nl=False)
        raise typer.Exit(1)
    path = unit_dir(system) / unit_name(kind, unit)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")
    for step in (("daemon-reload",), ("enable", "--now", path.name)):
        done = _systemctl(system, *step)
        if done.returncode != 0:
            fail(f"systemctl {' '.join(step)} failed: {(done.stderr or done.stdout).strip()}")
    console().print(f"installed and started {path.name} ({path}); see 'tether {kind} status'", soft_wrap=True,
                    markup=False)


def _uninstall(kind: Kind, system: bool, unit: str | None) -> None:
    path = unit_dir(system) / unit_name(kind, unit)
    problem = systemd_problem(system)
    if problem:
        fail(f"cannot uninstall: {problem}")
    if not path.exists():
        fail(f"{path} is not installed")
    _systemctl(system, "disable", "--now", path.name)
    try:
        path.unlink()
    except OSError as exc:
        fail(f"cannot remove {path}: {exc.strerror or exc}")
    _systemctl(system, "daemon-reload")
    console().print(f"stopped, disabled and removed {path.name}", markup=False)


def _status(kind: Kind, system: bool, unit: str | None) -> None:
    name = unit_name(kind, unit)
    problem = systemd_problem(system)
    if problem:
        fail(f"cannot ask systemd: {problem}")
    done = _systemctl(system, "status", "--no-pager", "--lines=20", name)
    typer.echo(done.stdout or done.stderr, nl=False)
    raise typer.Exit(0 if done.returncode == 0 else 3)  # systemctl's own: 3 is "not running"


@device_app.command("install", context_settings=_PASS)
def device_install(ctx: typer.Context, user: UserOpt = False, system: SystemOpt = False, print_only: PrintOpt = False,
                   unit: UnitOpt = None) -> None:
    """Install this device as a systemd service; options after '--' are 'tether device' options
    (e.g. -- --server wss://host:8765 --token-file /etc/tether/laptop.token)."""
    _install("device", ctx, user, system, print_only, unit)


@device_app.command("uninstall")
def device_uninstall(system: SystemOpt = False, unit: UnitOpt = None) -> None:
    """Stop, disable and remove the device's systemd unit."""
    _uninstall("device", system, unit)


@device_app.command("status")
def device_status(system: SystemOpt = False, unit: UnitOpt = None) -> None:
    """The device service's state and its latest log lines (systemctl status)."""
    _status("device", system, unit)


@server_app.command("install", context_settings=_PASS)
def server_install(ctx: typer.Context, user: UserOpt = False, system: SystemOpt = False, print_only: PrintOpt = False,
                   unit: UnitOpt = None) -> None:
    """Install the agent server as a systemd service; options after '--' are 'tether server' options."""
    _install("server", ctx, user, system, print_only, unit)


@server_app.command("uninstall")
def server_uninstall(system: SystemOpt = False, unit: UnitOpt = None) -> None:
    """Stop, disable and remove the server's systemd unit."""
    _uninstall("server", system, unit)


@server_app.command("status")
def server_status(system: SystemOpt = False, unit: UnitOpt = None) -> None:
    """The server service's state and its latest log lines (systemctl status)."""
    _status("server", system, unit)
