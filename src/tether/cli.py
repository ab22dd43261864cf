"""The `tether` command: list and run tools, undo a session's file changes, run the demo."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from tether.protocol.models import Command, Result, ResultStatus, ToolInfo, ToolType

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="tether: safe, fast and auditable hands for language-model agents.")
tools_app = typer.Typer(invoke_without_command=True, help="List tools, or serve a built-in tool set over MCP.")
app.add_typer(tools_app, name="tools")

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="device config (YAML, or mcpServers JSON)")]
PolicyOpt = Annotated[Path | None, typer.Option("--policy", help="policy file (YAML)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
StateOpt = Annotated[Path | None, typer.Option("--state-dir", help="where the undo journal lives")]


def _console(err: bool = False) -> Console:
    return Console(stderr=err, highlight=False)


def _fail(message: str, code: int = 2) -> None:
    _console(err=True).print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


def _run(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except ValueError as exc:  # configuration and policy files: say what is wrong, no traceback
        _fail(str(exc))


@tools_app.callback()
def tools(ctx: typer.Context, config: ConfigOpt = None, policy: PolicyOpt = None, as_json: JsonOpt = False,
          tool_type: Annotated[str | None, typer.Option("--type", help="data_collection or action")] = None,
          namespace: Annotated[str | None, typer.Option("--namespace", "-n")] = None) -> None:
    """List every tool with its namespace, type and parameters (--json for full schemas)."""
    if ctx.invoked_subcommand is not None:
        return
    if tool_type not in (None, "data_collection", "action"):
        _fail("--type must be data_collection or action")
    infos, problems, collisions = _run(_list_tools(config, policy, tool_type, namespace))
    if as_json:
        typer.echo(json.dumps([i.model_dump() for i in infos], indent=2))
        return
    table = Table(title=f"{len(infos)} tools")
    for col in ("tool", "namespace", "type", "parameters"):
        table.add_column(col)
    for info in infos:
        table.add_row(info.name, info.namespace, info.tool_type, _params_summary(info))
    console = _console()
    console.print(table)
    for namespace_name, error in problems.items():
        console.print(f"[yellow]server {namespace_name} is unavailable:[/yellow] {error}")
    for c in collisions:
        console.print(f"[dim]{c['tool']} ({c['tool_type']}) is {c['kept']}'s; {c['shadowed']}'s is {c['use']}[/dim]")


async def _list_tools(config: Path | None, policy: Path | None, tool_type: str | None,
                      namespace: str | None) -> tuple[list[ToolInfo], dict[str, str], list[dict[str, Any]]]:
    from tether.device.local import open_device

    async with open_device(config, policy_path=policy) as device:
        computer = await device.computer_manager.get_or_create(None)
        infos = computer.tool_infos(tool_type, namespace)  # type: ignore[arg-type]
        return infos, dict(computer.startup_errors), list(computer.collisions)


def _params_summary(info: ToolInfo) -> str:
    props = info.input_schema.get("properties", {})
    required = set(info.input_schema.get("required", []))
    parts = []
    for name, prop in props.items():
        kind = prop.get("type") or "|".join(p.get("type", "?") for p in prop.get("anyOf", []))
        parts.append(f"{name}{'' if name in required else '?'}:{kind}")
    return ", ".join(parts)


@tools_app.command("serve")
def tools_serve(name: Annotated[str, typer.Argument(help="built-in tool set: shell, files or system")],
                http: Annotated[bool, typer.Option("--http", help="streamable HTTP instead of stdio")] = False,
                host: str = "127.0.0.1", port: int = 8766, policy: PolicyOpt = None,
                state_dir: StateOpt = None) -> None:
    """Serve a built-in tool set as a real MCP server, for any MCP client."""
    from tether.tools.builtin import builtin_toolsets
    from tether.tools.context import ToolContext, default_state_dir
    from tether.tools.journal import UndoJournal
    from tether.tools.mcp_export import serve_http, serve_stdio, toolset_to_mcp
    from tether.tools.policy import default_policy, load_policy

    factories = builtin_toolsets()
    if name not in factories:
        _fail(f"unknown tool set '{name}'; available: {', '.join(factories)}")
    try:
        pol = load_policy(policy) if policy else default_policy()
    except ValueError as exc:
        _fail(str(exc))
    journal = UndoJournal(Path(state_dir or default_state_dir()))
    session = f"mcp-{uuid.uuid4().hex[:8]}"
    server = toolset_to_mcp(factories[name](),
                            lambda: ToolContext(policy=pol, journal=journal, session_id=session))
    if http:
        _console(err=True).print(f"serving '{name}' over streamable HTTP on http://{host}:{port}/mcp")
        asyncio.run(serve_http(server, host, port))
    else:
        asyncio.run(serve_stdio(server))


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


@app.command("exec")
def exec_(tool: Annotated[str, typer.Argument(help="tool name, e.g. shell.run")],
          args: Annotated[list[str] | None, typer.Argument(help="key=value or key:=json")] = None,
          config: ConfigOpt = None, policy: PolicyOpt = None, as_json: JsonOpt = False,
          session: Annotated[str | None, typer.Option("--session", help="session id (for undo)")] = None,
          approve: Annotated[bool, typer.Option("--approve", help="approve an action the policy "
                                                                  "reserves for a person")] = False,
          timeout: Annotated[float | None, typer.Option("--timeout", help="seconds")] = None,
          tool_type: Annotated[str | None, typer.Option("--type")] = None, state_dir: StateOpt = None) -> None:
    """Run one tool and print its structured result; exit code 1 when the result is a failure."""
    if tool_type not in (None, "data_collection", "action"):
        _fail("--type must be data_collection or action")
    session_id = session or f"cli-{uuid.uuid4().hex[:12]}"
    result = _run(_exec(tool, args or [], config, policy, session_id, approve, timeout, tool_type, state_dir))
    if as_json:
        typer.echo(json.dumps({"session_id": session_id, **result.model_dump(mode="json")}, indent=2))
    else:
        _print_result(result, session_id)
    if result.status is not ResultStatus.SUCCESS:
        raise typer.Exit(1)


async def _exec(tool: str, pairs: list[str], config: Path | None, policy: Path | None, session_id: str,
                approve: bool, timeout: float | None, tool_type: str | None, state_dir: Path | None) -> Result:
    import getpass

    from tether.device.local import open_device

    async with open_device(config, policy_path=policy, state_dir=state_dir) as device:
        computer = await device.computer_manager.get_or_create(None)
        schema = next((i.input_schema for i in computer.tool_infos(remove_meta=False)
                       if i.name == tool and (tool_type is None or i.tool_type == tool_type)), {})
        params = parse_assignments(pairs, schema)
        kind: ToolType | None = tool_type  # type: ignore[assignment]
        command = Command(tool_name=tool, parameters=params, tool_type=kind, timeout=timeout,
                          approved_by=f"cli:{getpass.getuser()}" if approve else None)
        dispatcher = device.dispatcher(session_id=session_id)
        dispatcher.emit = _stream_to_terminal
        [result] = await dispatcher.execute_commands([command], timeout=(timeout or 3600) + 5)
        return result


def _stream_to_terminal(kind: str, data: dict[str, Any]) -> None:
    if kind == "output" and sys.stderr.isatty():
        sys.stderr.write(str(data.get("data", "")))


def _print_result(result: Result, session_id: str) -> None:
    console = _console()
    style = {"success": "green", "failure": "red", "skipped": "yellow"}.get(result.status.value, "white")
    console.print(f"[{style}]{result.status.value}[/{style}]  namespace={result.namespace}  "
                  f"call_id={result.call_id}  session={session_id}")
    if result.error:
        console.print(f"[red]error:[/red] {result.error}")
    payload = result.result
    if isinstance(payload, dict) and ("stdout" in payload or "stderr" in payload):
        for stream in ("stdout", "stderr"):
            if payload.get(stream):
                console.print(f"[bold]{stream}:[/bold]")
                console.out(payload[stream], end="" if str(payload[stream]).endswith("\n") else "\n")
        rest = {k: v for k, v in payload.items() if k not in ("stdout", "stderr")}
        console.print_json(json.dumps(rest, default=str))
    elif payload is not None:
        console.print_json(json.dumps(payload, default=str))


@app.command()
def undo(session: Annotated[str, typer.Argument(help="the session whose file changes to put back")],
         state_dir: StateOpt = None, as_json: JsonOpt = False) -> None:
    """Put back the files that a session's commands changed."""
    from tether.tools.context import default_state_dir
    from tether.tools.journal import UndoJournal

    journal = UndoJournal(Path(state_dir or default_state_dir()))
    try:
        report = journal.restore(session)
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(report, indent=2, default=str))
        return
    if not report:
        _console().print(f"nothing to undo for session {session}")
        return
    table = Table(title=f"undo {session}")
    for col in ("action", "path", "outcome"):
        table.add_column(col)
    for entry in report:
        table.add_row(str(entry.get("action")), str(entry.get("path")), str(entry.get("outcome")))
    _console().print(table)


@app.command()
def sessions(state_dir: StateOpt = None, as_json: JsonOpt = False) -> None:
    """List the sessions that have journaled file changes (what `undo` can put back)."""
    from tether.tools.context import default_state_dir
    from tether.tools.journal import UndoJournal

    rows = UndoJournal(Path(state_dir or default_state_dir())).sessions()
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    table = Table(title="journaled sessions")
    keys = list(rows[0]) if rows else ["session_id"]
    for key in keys:
        table.add_column(key)
    for row in rows:
        table.add_row(*(str(row.get(k)) for k in keys))
    _console().print(table)


@app.command()
def demo(state_dir: StateOpt = None) -> None:
    """Run a short local demo: tools, a real process, a file change and its undo, a policy denial."""
    from tether.demo import run_demo

    code = _run(run_demo(_console(), state_dir))
    raise typer.Exit(code)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
