"""What every `tether` sub-command shares: the app, options, output and argument parsing."""

from __future__ import annotations

import json
import re
import sys
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperGroup, TyperOption

from tether.cli.lazy import COMMAND_PANELS, LazyGroup
from tether.cli.views.safe_text import console, say, visible

if TYPE_CHECKING:
    from tether.client.rest import RemoteError  # httpx: imported by the commands that talk to a server
    from tether.protocol.models import Result, ToolInfo  # pydantic: not for `tether --help`


class ExitCode(IntEnum):
    """tether's exit codes, the same in every command (README, "Exit codes")."""

    OK = 0
    FAILED = 1  # the task, command or request failed, or the server refused it
    USAGE = 2  # bad arguments, or a bad config, policy or plan file (click's usage errors are 2 as well)
    WAITING = 3  # a person must act: a question left unanswered, an approval pending
    UNREACHABLE = 4  # the server could not be reached, or the connection to it was lost
    # Ctrl-C (SIGINT), as a shell reports it (typer's own code for an interrupted command too): a server's task
    # goes on
    INTERRUPTED = 130


INTERRUPTED = ExitCode.INTERRUPTED


class _Option(TyperOption):
    """Labels a value by what to type (TEXT, PATH, N), a flag by nothing: typer 0.29's default labels
    (`<bool>`, `<list[str]>`) are Python annotations that read as argument names."""

    def display_type_rich(self, ctx: Any) -> str | None:
        if self.metavar is not None:
            return self.metavar
        if self.is_flag:
            return None
        return _type_label(self.type_descriptor)


class _Argument(TyperArgument):
    """An argument is shown by its name (REQUEST, TASK); a type label beside it only repeats it."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None


def _type_label(desc: Any) -> str:
    if desc.is_choice:
        return "|".join(str(getattr(c, "value", c)) for c in desc.choices or ())
    if desc.is_path:
        return "PATH"
    annotation = desc.annotation
    if desc.is_list:
        args = getattr(annotation, "__args__", ()) or (str,)
        annotation = args[0]
    return {int: "N", float: "NUMBER", bool: "BOOL"}.get(annotation, "TEXT")


def _label(params: list[Any]) -> list[Any]:
    for param in params:
        if type(param) is TyperOption:
            param.__class__ = _Option  # same fields, only the help label differs
        elif type(param) is TyperArgument:
            param.__class__ = _Argument
            param.metavar = param.metavar or str(param.name).upper()
    return params


def _tidy(command: Any) -> None:
    """Label the parameters of `command` and its sub-commands for people (see `_Option`). Through
    `get_params`, because click adds `--help` (and typer the completion options) only there."""
    original = command.get_params
    command.get_params = lambda ctx: _label(original(ctx))
    _label(command.params)
    command.format_help = _fitted_help(command.format_help)
    for sub in getattr(command, "commands", {}).values():
        _tidy(sub)


def _fitted_help(format_help: Any) -> Any:
    """`format_help` drawing its option panels with option names never cut (`rich_help.narrow_options`)."""

    def fitted(ctx: Any, formatter: Any) -> None:
        from tether.cli.views.rich_help import narrow_options

        with narrow_options():
            format_help(ctx, formatter)

    return fitted


class TetherGroup(LazyGroup):
    """The root group: commands in topic panels and a useful order, parameters labelled for people;
    each command's module imported when it is used (`LazyGroup`)."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        _tidy(self)
        for panel, names in COMMAND_PANELS:
            for name in names:
                if name in self.commands:
                    self.commands[name].rich_help_panel = panel  # type: ignore[attr-defined]

    def list_commands(self, ctx: Any) -> list[str]:
        known = super().list_commands(ctx)  # those attached and those not imported yet
        ordered = [name for _, names in COMMAND_PANELS for name in names if name in known]
        return ordered + [name for name in known if name not in ordered]

    def root_app(self) -> typer.Typer:
        """`app`: the command modules attach to it and its sub-apps."""
        return app


class DevicesGroup(TyperGroup):
    """`tether devices`: a first word that names no sub-command, and is not a near miss of one (`pendng`: a
    usage error with "did you mean"), is a device's name, so `tether devices NAME` runs `tether devices
    show NAME` (docs/fleet.md)."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and not args[0].startswith("-") and args[0] not in self.commands and "show" in self.commands:
            import difflib

            if not difflib.get_close_matches(args[0], list(self.commands), n=1, cutoff=0.85):
                return "show", self.commands["show"], args
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=TetherGroup, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                  help="tether: safe, fast and auditable hands for language-model agents.",
                  epilog="Exit codes: 0 done, 1 failed or refused, 2 bad usage, configuration or token, "
                         "3 waiting for a person, 4 server unreachable.")
tools_app = typer.Typer(invoke_without_command=True, help="List tools, or serve a built-in tool set over MCP.")
token_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke device and API tokens.")
mcp_app = typer.Typer(no_args_is_help=True,
                      help="MCP: plug a server's fleet into an MCP client, or serve this machine's tools.")
# `tether server`, `tether device` and `tether devices` run (or list) by themselves (cli/commands/setup/)
# and also have sub-commands (install, uninstall, status: commands/setup/systemd.py; pending, approve, refuse:
# commands/fleet/pairing.py)
server_app = typer.Typer(help="Start the agent server, or install it as a service.")
device_app = typer.Typer(help="Connect this machine to a server as a device, or install it as a service.")
devices_app = typer.Typer(cls=DevicesGroup, help="Show the server's devices, and let pairing devices in.")
app.add_typer(tools_app, name="tools")
app.add_typer(token_app, name="token")
app.add_typer(mcp_app, name="mcp")
app.add_typer(server_app, name="server")
app.add_typer(device_app, name="device")
app.add_typer(devices_app, name="devices")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"tether {version('tether')}")
        raise typer.Exit()


@app.callback()
def _root(show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                     help="print tether's version and exit")] = False) -> None:
    """tether: safe, fast and auditable hands for language-model agents."""


ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="the config file: sections llm, device, server, policy, mcp, mcpServers (YAML, or a "
                           "desktop client's mcpServers JSON); default $TETHER_CONFIG or ~/.config/tether/config.yaml")]
PolicyOpt = Annotated[Path | None, typer.Option("--policy", help="policy file (YAML)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
OutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", metavar="wide|json", help="wide: every column, however wide; json: as --json")]
StateOpt = Annotated[Path | None, typer.Option("--state-dir", metavar="DIR", help="where the undo journal lives")]
def _complete_devices(ctx: typer.Context, incomplete: str) -> list[str]:
    """The server's device names (`tether.cli.completion`, imported only when a shell completes)."""
    from tether.cli.completion import devices

    return devices(ctx, incomplete)


DeviceOpt = Annotated[str | None, typer.Option("--device", "-d", metavar="DEVICE", autocompletion=_complete_devices,
                                               help="run on this device through the server")]
ServerOpt = Annotated[str | None, typer.Option("--server", envvar="TETHER_SERVER", metavar="URL",
                                               help="agent server URL (default http://127.0.0.1:8765)")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="TETHER_TOKEN", metavar="TOKEN",
                                              help="API token (better in TETHER_TOKEN: a flag shows in ps)")]
CaOpt = Annotated[str | None, typer.Option("--ca-file", envvar="TETHER_CA_FILE", metavar="FILE",
                                           help="CA certificate to verify a self-signed server")]


def output_mode(output: str | None, as_json: bool) -> tuple[bool, bool]:
    """`(json, wide)` from `-o/--output` and `--json`; another `-o` value fails with `ExitCode.USAGE`."""
    if output not in (None, "wide", "json"):
        fail(f"-o/--output is wide or json, not {output!r}", ExitCode.USAGE)
    return as_json or output == "json", output == "wide"


def fail(message: str, code: int = 2) -> NoReturn:
    """`message` is plain text, never markup: it often quotes a tool, a server or pydantic, whose
    `[type=missing …]` or a path like `[/x]` rich would eat or choke on."""
    say(f"error: {message}", err=True)
    raise typer.Exit(code)


def remote_message(exc: RemoteError) -> str:
    """The server's refusal in CLI terms: what to set or pass, not which HTTP header to send."""
    text = str(exc)
    if exc.status == 401 and "missing bearer token" in text:
        return ("no API token: set TETHER_TOKEN or pass --token (on the server's machine, "
                "'tether token create --api NAME' makes one)")
    if exc.status == 401 and "unknown or revoked token" in text:
        return "the API token (TETHER_TOKEN or --token) is unknown or revoked: 'tether token list' shows the live ones"
    if exc.status == 403 and (scope := re.search(r"lacks the '(\w+)' scope", text)):
        return (f"{text.removeprefix('server answered 403: ')}: use a token that has it "
                f"('tether token create --api NAME --scope {scope.group(1)}' on the server's machine)")
    if exc.status is None and "cannot reach" in text:
        return f"{text}\n  {unreachable_hint(text)}"
    return text.replace("('Authorization: Bearer <api token>')", "(set TETHER_TOKEN or pass --token)")


def unreachable_hint(text: str) -> str:
    """What to check when the server was not reached, from the error's words: a URL without its scheme,
    a TLS failure (an untrusted certificate or a pin that does not match), a refused connection (is the
    server running?), or else where the URL comes from."""
    lowered = text.lower()
    if "missing an 'http://' or 'https://' protocol" in lowered or "unsupported protocol" in lowered:
        return "the server URL needs its scheme: --server http://HOST:PORT (https:// with TLS)"
    if any(word in lowered for word in ("ssl", "certificate", "tls", "fingerprint", "pinned", "pin mismatch")):
        return ("a TLS problem, not a server that is down: for a self-signed certificate pass its CA with --ca-file "
                "(or TETHER_CA_FILE); check that a pinned fingerprint is the server's ('tether server' prints it)")
    if "refused" in lowered:
        return "is it running ('tether server')? --server or TETHER_SERVER say where it is"
    return "--server or TETHER_SERVER say where it is (check the host name and port)"


def remote_exit_code(exc: RemoteError, code: int = ExitCode.FAILED) -> int:
    """The exit code for a server's no, the same from every command: `ExitCode.UNREACHABLE` when it was not
    reached, `ExitCode.USAGE` for no token or a dead one, `ExitCode.FAILED` for a token that lacks the scope
    the command needs (the server refused it, README "Exit codes"), else `code` (the command's own)."""
    if exc.status is None:
        return ExitCode.UNREACHABLE
    if exc.status == 401:
        return ExitCode.USAGE
    if exc.status == 403 and "lacks the '" in str(exc):
        return ExitCode.FAILED
    return code


def fail_remote(exc: RemoteError, code: int = ExitCode.FAILED, hint: str = "") -> NoReturn:
    """One place that turns a server's no into an exit (`remote_exit_code`) with its words (`remote_message`)."""
    fail(remote_message(exc) + hint, remote_exit_code(exc, code))


def run_async(coro: Any) -> Any:
    import asyncio

    try:
        return asyncio.run(coro)
    except ValueError as exc:  # configuration and policy files: say what is wrong, no traceback
        fail(str(exc))


def check_tool_type(tool_type: str | None) -> None:
    if tool_type not in (None, "data_collection", "action"):
        fail("--type must be data_collection or action")


def params_summary(info: ToolInfo) -> str:
    props = info.input_schema.get("properties", {})
    required = set(info.input_schema.get("required", []))
    parts = []
    for name, prop in props.items():
        kind = prop.get("type") or "|".join(p.get("type", "?") for p in prop.get("anyOf", []))
        parts.append(f"{name}{'' if name in required else '?'}:{kind}")
    return ", ".join(parts)


def print_tools(infos: list[ToolInfo], as_json: bool, title: str = "") -> None:
    if as_json:
        typer.echo(json.dumps([i.model_dump() for i in infos], indent=2))
        return
    table = Table(title=f"{len(infos)} tools{title}")
    for col in ("tool", "namespace", "type", "parameters"):
        table.add_column(col)
    for info in infos:
        table.add_row(*(Text(cell) for cell in (info.name, info.namespace, info.tool_type, params_summary(info))))
    console().print(table)


def parse_assignments(pairs: list[str], schema: dict[str, Any]) -> dict[str, Any]:
    """`key=value` (JSON where the parameter is not a string, else text) and `key:=json` (always JSON)."""
    props = schema.get("properties", {})
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        raw_json = key.endswith(":")
        key = key.removesuffix(":")
        if not sep or not key:
            raise ValueError(f"argument {pair!r} is not key=value (or key:=json)")
        if raw_json:
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"argument {key}: not valid JSON: {exc.msg}") from exc
            continue
        if _wants_string(props.get(key, {})):
            out[key] = value
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parse_requires(items: list[str]) -> dict[str, Any]:
    """`--require` values as DeviceRequirements fields; ValueError names a bad one."""
    req: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if key == "gpu":
            if sep and value.lower() not in ("true", "false", "yes", "no", "1", "0"):
                raise ValueError(f"--require {item}: gpu is true or false")
            req["gpu"] = not sep or value.lower() in ("true", "yes", "1")
        elif key == "platform" and value:
            req[key] = value
        elif key in ("tag", "tags", "tool", "tools") and value:
            field = key.rstrip("s") + "s"
            req.setdefault(field, []).extend(v.strip() for v in value.split(",") if v.strip())
        else:
            raise ValueError(f"--require {item!r}: expected platform=NAME, tag=NAME, tool=NAME or gpu[=false]")
    return req


def _wants_string(prop: dict[str, Any]) -> bool:
    types = {prop.get("type")} | {p.get("type") for p in prop.get("anyOf", [])}
    types.discard(None)
    types.discard("null")
    return types == {"string"}


def stream_output(kind: str, data: dict[str, Any], raw: bool = False) -> None:
    """Live stdout/stderr of a running command, on the terminal only (results carry it anyway); its control
    characters shown as escapes but `\n` and `\t` (`safe_text.visible`) unless `raw`."""
    if kind == "output" and sys.stderr.isatty():
        data_text = str(data.get("data", ""))
        sys.stderr.write(data_text if raw else visible(data_text))
        sys.stderr.flush()
    elif kind == "queued":  # the device runs as many sessions as it may: this one waits in line
        sys.stderr.write(f"waiting: the device is busy; number {data.get('position')} in line\n")
        sys.stderr.flush()
    elif kind == "starting":  # the tool may be an external MCP server's that the device is still starting
        servers = visible(", ".join(map(str, data.get("servers") or [])), one_line=True)
        sys.stderr.write(f"waiting: MCP server(s) still starting on the device: {servers}\n")
        sys.stderr.flush()
    elif kind == "progress":  # an external MCP tool's progress: not in the result, so always shown
        sys.stderr.write(progress_line(data) + "\n")
        sys.stderr.flush()


def progress_line(data: dict[str, Any]) -> str:
    """`progress server.tool: 2/3 step 2 of 3` (plain text: a server's message is never markup)."""
    done, total = data.get("progress"), data.get("total")
    amount = f"{done:g}/{total:g}" if isinstance(done, int | float) and isinstance(total, int | float) else (
        f"{done:g}" if isinstance(done, int | float) else "")
    message = str(data.get("message") or "").replace("\n", " ")[:300]
    return visible(f"progress {data.get('server', '?')}.{data.get('tool', '?')}: {amount} {message}".rstrip(),
                   one_line=True)


def print_result(result: Result, session_id: str | None, device: str | None = None, raw: bool = False) -> None:
    """A tool's result. Its stdout and stderr are shown with control characters as escapes (but `\n` and
    `\t`) unless `raw`, which writes them as the command wrote them."""
    out = console()
    style = {"success": "green", "failure": "red", "skipped": "yellow"}.get(result.status.value, "white")
    shown = "outcome pending" if result.outcome_pending else result.status.value  # not a failure: docs/outcomes.md
    style = "yellow" if result.outcome_pending else style
    where = f"  device={escape(device)}" if device else ""
    out.print(f"[{style}]{shown}[/{style}]{where}  namespace={escape(str(result.namespace))}  "
              f"call_id={result.call_id}  session={session_id}")
    if result.error:
        say(f"error: {result.error}")
    payload = result.result
    if isinstance(payload, dict) and ("stdout" in payload or "stderr" in payload):
        for stream in ("stdout", "stderr"):
            if payload.get(stream):
                out.print(f"[bold]{stream}:[/bold]")
                body = str(payload[stream])
                if raw:
                    sys.stdout.write(body if body.endswith("\n") else body + "\n")
                    sys.stdout.flush()
                else:
                    out.out(body, end="" if body.endswith("\n") else "\n")
        rest = {k: v for k, v in payload.items() if k not in ("stdout", "stderr")}
        out.print_json(json.dumps(rest, default=str))
    elif payload is not None:
        out.print_json(json.dumps(payload, default=str))
