"""What every `tether` sub-command shares: the app, options, output and argument parsing."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from tether.protocol.models import Result, ToolInfo

app = typer.Typer(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                  help="tether: safe, fast and auditable hands for language-model agents.")
tools_app = typer.Typer(invoke_without_command=True, help="List tools, or serve a built-in tool set over MCP.")
token_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke device and API tokens.")
mcp_app = typer.Typer(no_args_is_help=True,
                      help="MCP: plug a server's fleet into an MCP client, or serve this machine's tools.")
app.add_typer(tools_app, name="tools")
app.add_typer(token_app, name="token")
app.add_typer(mcp_app, name="mcp")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"tether {version('tether')}")
        raise typer.Exit()


@app.callback()
def _root(show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                     help="print tether's version and exit")] = False) -> None:
    """tether: safe, fast and auditable hands for language-model agents."""


ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="device config (YAML, or mcpServers JSON)")]
PolicyOpt = Annotated[Path | None, typer.Option("--policy", help="policy file (YAML)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
StateOpt = Annotated[Path | None, typer.Option("--state-dir", help="where the undo journal lives")]
DeviceOpt = Annotated[str | None, typer.Option("--device", "-d", help="run on this device through the server")]
ServerOpt = Annotated[str | None, typer.Option("--server", envvar="TETHER_SERVER",
                                               help="agent server URL (default http://127.0.0.1:8765)")]
TokenOpt = Annotated[str | None, typer.Option("--token", envvar="TETHER_TOKEN", help="API token")]
CaOpt = Annotated[str | None, typer.Option("--ca-file", envvar="TETHER_CA_FILE",
                                           help="CA certificate to verify a self-signed server")]


def console(err: bool = False) -> Console:
    return Console(stderr=err, highlight=False)


def fail(message: str, code: int = 2) -> NoReturn:
    console(err=True).print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


def run_async(coro: Any) -> Any:
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
        table.add_row(info.name, info.namespace, info.tool_type, params_summary(info))
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


def _wants_string(prop: dict[str, Any]) -> bool:
    types = {prop.get("type")} | {p.get("type") for p in prop.get("anyOf", [])}
    types.discard(None)
    types.discard("null")
    return types == {"string"}


def stream_output(kind: str, data: dict[str, Any]) -> None:
    """Live stdout/stderr of a running command, on the terminal only (results carry it anyway)."""
    if kind == "output" and sys.stderr.isatty():
        sys.stderr.write(str(data.get("data", "")))
        sys.stderr.flush()
    elif kind == "queued":  # the device runs as many sessions as it may: this one waits in line
        sys.stderr.write(f"waiting: the device is busy; number {data.get('position')} in line\n")
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
    return f"progress {data.get('server', '?')}.{data.get('tool', '?')}: {amount} {message}".rstrip()


def print_result(result: Result, session_id: str | None, device: str | None = None) -> None:
    out = console()
    style = {"success": "green", "failure": "red", "skipped": "yellow"}.get(result.status.value, "white")
    where = f"  device={device}" if device else ""
    out.print(f"[{style}]{result.status.value}[/{style}]{where}  namespace={result.namespace}  "
              f"call_id={result.call_id}  session={session_id}")
    if result.error:
        out.print(f"[red]error:[/red] {result.error}")
    payload = result.result
    if isinstance(payload, dict) and ("stdout" in payload or "stderr" in payload):
        for stream in ("stdout", "stderr"):
            if payload.get(stream):
                out.print(f"[bold]{stream}:[/bold]")
                out.out(payload[stream], end="" if str(payload[stream]).endswith("\n") else "\n")
        rest = {k: v for k, v in payload.items() if k not in ("stdout", "stderr")}
        out.print_json(json.dumps(rest, default=str))
    elif payload is not None:
        out.print_json(json.dumps(payload, default=str))
