"""What every `tether` sub-command shares: the app, options, output and argument parsing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperGroup, TyperOption

# what needs no typer lives in tether.cli.basics (the fast path's commands import it from there)
from tether.cli.basics import INTERRUPTED as INTERRUPTED
from tether.cli.basics import ExitCode as ExitCode
from tether.cli.basics import check_tool_type as check_tool_type
from tether.cli.basics import parse_assignments as parse_assignments
from tether.cli.basics import print_result as print_result
from tether.cli.basics import progress_line as progress_line
from tether.cli.basics import remote_exit_code as remote_exit_code
from tether.cli.basics import remote_message as remote_message
from tether.cli.basics import stream_output as stream_output
from tether.cli.basics import unreachable_hint as unreachable_hint
from tether.cli.lazy import COMMAND_PANELS, LazyGroup
from tether.cli.views.safe_text import console as console
from tether.cli.views.safe_text import say as say
from tether.cli.views.safe_text import visible as visible

if TYPE_CHECKING:
    from tether.client.rest import RemoteError  # httpx: imported by the commands that talk to a server
    from tether.protocol.models import ToolInfo  # pydantic: not for `tether --help`


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


def fail_remote(exc: RemoteError, code: int = ExitCode.FAILED, hint: str = "") -> NoReturn:
    """One place that turns a server's no into an exit (`remote_exit_code`) with its words (`remote_message`)."""
    fail(remote_message(exc) + hint, remote_exit_code(exc, code))


def run_async(coro: Any) -> Any:
    import asyncio

    try:
        return asyncio.run(coro)
    except ValueError as exc:  # configuration and policy files: say what is wrong, no traceback
        fail(str(exc))


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
