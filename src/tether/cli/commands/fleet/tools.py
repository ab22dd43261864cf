"""`tether tools`, `tether tools serve` and `tether exec`: locally, or on a device through the server."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from tether.cli import completion as complete
from tether.cli.common import (
    CaOpt,
    ConfigOpt,
    DeviceOpt,
    ExitCode,
    JsonOpt,
    PolicyOpt,
    ServerOpt,
    StateOpt,
    TokenOpt,
    app,
    check_tool_type,
    console,
    fail,
    fail_remote,
    parse_assignments,
    print_result,
    print_tools,
    run_async,
    stream_output,
    tools_app,
)
from tether.cli.root_guard import AllowRootOpt, guard_root
from tether.protocol.models import Command, Result, ResultStatus, ToolInfo, ToolType


def end_session() -> Command:
    """What a one-off call (no --session) tells the device after it: its session has ended, and the device
    drops what it kept for it alone (`Computer.end_session`: the session's private /tmp)."""
    return Command(tool_name="end_session")

if TYPE_CHECKING:
    from tether.device.local import LocalDevice


@tools_app.callback()
def tools(ctx: typer.Context, config: ConfigOpt = None, policy: PolicyOpt = None, as_json: JsonOpt = False,
          tool_type: Annotated[str | None, typer.Option("--type", help="data_collection or action")] = None,
          namespace: Annotated[str | None, typer.Option("--namespace", "-n",
                                                                 help="only this namespace's tools")] = None,
          device: DeviceOpt = None, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None
          ) -> None:
    """List every tool with its namespace, type and parameters (--json for full schemas)."""
    if ctx.invoked_subcommand is not None:
        return
    check_tool_type(tool_type)
    if device:
        from tether.client.rest import RemoteError, RemoteServer  # httpx: only to reach a server

        try:
            with RemoteServer(server, token, ca_file=ca_file) as remote:
                infos = remote.tools(device)
        except RemoteError as exc:
            fail_remote(exc, ExitCode.USAGE)
        infos = [i for i in infos if (not tool_type or i.tool_type == tool_type)
                 and (not namespace or i.namespace == namespace)]
        print_tools(infos, as_json, f" on {device}")
        return
    infos, problems, collisions, disabled = run_async(_list_tools(config, policy, tool_type, namespace))
    print_tools(infos, as_json)
    if as_json:
        return
    out = console()
    for namespace_name, error in problems.items():
        out.print(f"[yellow]server {escape(namespace_name)} is unavailable:[/yellow] {escape(str(error))}")
    for name in disabled:
        out.print(f"server {name} is disabled in the config (disabled: true): not started", style="dim", markup=False)
    for c in collisions:
        out.print(f"{c['tool']} ({c['tool_type']}) is {c['kept']}'s; {c['shadowed']}'s is {c['use']}", style="dim",
                  markup=False)


async def _list_tools(config: Path | None, policy: Path | None, tool_type: str | None, namespace: str | None
                      ) -> tuple[list[ToolInfo], dict[str, str], list[dict[str, Any]], list[str]]:
    from tether.device.local import open_local_device

    async with open_local_device(config, policy_path=policy) as device:
        computer = await device.computer_manager.get_or_create(None)
        infos = computer.tool_infos(tool_type, namespace)  # type: ignore[arg-type]
        return infos, dict(computer.startup_errors), list(computer.collisions), list(device.config.disabled_servers)


@tools_app.command("serve")
def tools_serve(name: Annotated[str, typer.Argument(help="built-in tool set: shell, files or system")],
                http: Annotated[bool, typer.Option("--http", help="streamable HTTP instead of stdio")] = False,
                host: Annotated[str, typer.Option(help="with --http: address to listen on")] = "127.0.0.1",
                port: Annotated[int, typer.Option(help="with --http: port")] = 8766, policy: PolicyOpt = None,
                state_dir: StateOpt = None) -> None:
    """Serve a built-in tool set as a real MCP server, for any MCP client."""
    from tether.cli.state_lock import holding_state_dir
    from tether.tools.builtin import builtin_toolsets
    from tether.tools.context import default_state_dir
    from tether.tools.policy.model import default_policy, load_policy

    factories = builtin_toolsets()
    if name not in factories:
        fail(f"unknown tool set '{name}'; available: {', '.join(factories)}")
    try:
        pol = load_policy(policy) if policy else default_policy()
    except ValueError as exc:
        fail(str(exc))
    state = Path(state_dir or default_state_dir())
    with holding_state_dir(state, "tether tools serve"):  # one process per state directory
        _serve_toolset(factories, name, pol, state, http, host, port)


def _serve_toolset(factories: dict[str, Any], name: str, pol: Any, state: Path, http: bool, host: str,
                   port: int) -> None:
    """`tools serve` past its checks, with the state directory `state` held."""
    from tether.tools.context import ToolContext
    from tether.tools.journal import UndoJournal
    from tether.tools.mcp_export import serve_http, serve_stdio, toolset_to_mcp
    from tether.tools.optional import MissingDependency
    from tether.tools.sandboxing import make_sandbox

    journal = UndoJournal(state)
    session = f"mcp-{uuid.uuid4().hex[:8]}"
    try:
        toolset = factories[name]()
    except MissingDependency as exc:
        fail(str(exc))
    # the processes an MCP client's calls start are confined like a device's (a warning where they cannot be)
    sandbox = make_sandbox(pol, hidden=[str(state)]) if pol.sandbox else None
    server = toolset_to_mcp(toolset, lambda: ToolContext(policy=pol, journal=journal, session_id=session,
                                                         sandbox=sandbox, secrets=(str(state),)))

    async def serve() -> None:
        try:
            if http:
                console(err=True).print(f"serving '{name}' over streamable HTTP on http://{host}:{port}/mcp")
                await serve_http(server, host, port)
            else:
                await serve_stdio(server)
        finally:
            await toolset.aclose()  # e.g. the browser set's Chromium
            if sandbox is not None:
                await sandbox.aclose()

    try:
        asyncio.run(serve())
    except ValueError as exc:
        fail(str(exc))


@app.command("exec")
def exec_(tool: Annotated[str, typer.Argument(help="tool name, e.g. shell.run", autocompletion=complete.tools)],
          args: Annotated[list[str] | None, typer.Argument(help="key=value or key:=json")] = None,
          config: ConfigOpt = None, policy: PolicyOpt = None, as_json: JsonOpt = False,
          session: Annotated[str | None, typer.Option("--session", help="session id (for undo)")] = None,
          approve: Annotated[bool, typer.Option("--approve", help="approve an action the policy "
                                                                  "reserves for a person")] = False,
          always: Annotated[str | None, typer.Option(
              "--always", help="with --device, for a shell command the policy asks about: 'program' adds the "
                               "program to the device's allowlist for good, 'subcommand' only the program with "
                               "this first argument (e.g. git status); then runs it (needs the admin scope)")] = None,
          timeout: Annotated[float | None, typer.Option("--timeout", help="seconds")] = None,
          tool_type: Annotated[str | None, typer.Option("--type", metavar="data_collection|action",
                                                          help="the tool of this type, where a name has both")] = None,
          state_dir: StateOpt = None,
          device: DeviceOpt = None, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
          all_devices: Annotated[bool, typer.Option(
              "--all", help="run on every device of the server that meets --require, with a live progress bar "
                            "and a summary; exit code 1 when any device did not succeed")] = False,
          require: Annotated[list[str] | None, typer.Option(
              "--require", metavar="KEY=VALUE", help="with --all: platform=linux, tag=NAME, tool=NAME, gpu, "
                                                     "gpu=false; repeat to require several")] = None,
          max_concurrency: Annotated[int | None, typer.Option(
              "--max-concurrency", min=1, help="with --all: devices running the command at once (default 64)")] = None,
          save_dir: Annotated[Path | None, typer.Option(
              "--save-dir", help="where images and blobs of an MCP tool's result are saved (default: a new "
                                 "temporary directory)")] = None,
          raw: Annotated[bool, typer.Option(
              "--raw", help="write the command's output as it is, terminal control sequences included (by "
                            "default they are shown as escapes such as \\x1b)")] = False,
          allow_root: AllowRootOpt = False,
          ) -> None:
    """Run one tool and print its structured result; exit code 1 when the result is a failure."""
    check_tool_type(tool_type)
    if all_devices or require:
        _exec_all(tool, args or [], all_devices, device, always, approve, require or [], timeout, tool_type,
                  max_concurrency, as_json, server, token, ca_file)
        return
    if always is not None:
        if always not in ("program", "subcommand"):
            fail("--always takes program or subcommand")
        if not device:
            fail("--always changes a device's policy through its server: give --device")
        _allow_always(device, tool, args or [], always, server, token, ca_file)
    session_id = session or f"cli-{uuid.uuid4().hex[:12]}"
    approved_by = f"cli:{getpass.getuser()}" if approve else None
    one_off = session is None  # a session of this call alone: it ends with it (the device drops its /tmp)
    if device:
        result, schema = _exec_remote(device, tool, args or [], session_id, approved_by, timeout, tool_type,
                              server, token, ca_file, raw, one_off=one_off)
    else:
        guard_root(config, allow_root, "tether exec")  # a device in this process (tether.device.root)
        from tether.cli.state_lock import device_state, holding_state_dir

        with holding_state_dir(device_state(config, state_dir), "tether exec"):  # one process per state directory
            result, schema = run_async(_exec_local(tool, args or [], config, policy, session_id, approved_by,
                                                   timeout, tool_type, state_dir, end=one_off))
    if as_json:
        typer.echo(json.dumps({"session_id": session_id, "device": device, **result.model_dump(mode="json")},
                              indent=2))
    else:
        from tether.cli.views.mcp_content import is_mcp_shape, print_mcp_content

        if result.status is ResultStatus.SUCCESS and is_mcp_shape(result.result):
            print_result(result.model_copy(update={"result": None}), session_id, device)
            print_mcp_content(result.result, save_dir)
        else:
            print_result(result, session_id, device, raw=raw)
        hint = held_hint(result, schema, session_id) if not approve else None
        if hint:
            console().print(hint, soft_wrap=True, markup=False)
    if result.outcome_pending:  # not a failure: a person (or script) looks again later (tether batch ID)
        raise typer.Exit(ExitCode.WAITING)
    if result.status is not ResultStatus.SUCCESS:
        raise typer.Exit(1)


def held_hint(result: Result, schema: dict[str, Any], session_id: str) -> str | None:
    """What to do about a result the device's policy held for a person (None when it is not held).

    A command that ran in the sandbox and whose changes are held (`changes` in the result) is approved
    without running again; one held before it ran is run by approving it. `preview=true` is offered
    only when the tool's input schema has a `preview` parameter."""
    payload = result.result
    if not isinstance(payload, dict) or not payload.get("needs_approval"):
        return None
    if "changes" in payload or "changes_digest" in payload:
        preview = ("; add preview=true to list the changes without applying them"
                   if "preview" in schema.get("properties", {}) else "")
        return (f"nothing was applied. To apply exactly these changes (the command does not run again), repeat "
                f"it with --approve --session {session_id}{preview}")
    return "nothing was done: the policy asks a person first. To run it, repeat it with --approve"


def _exec_all(tool: str, pairs: list[str], all_devices: bool, device: str | None, always: str | None,
              approve: bool, require: list[str], timeout: float | None, tool_type: str | None,
              max_concurrency: int | None, as_json: bool, server: str | None, token: str | None,
              ca_file: str | None) -> None:
    """`--all`: the command on every matching device (cli/views/fanout.py); values are strings unless
    written key:=json, since no one device's schema speaks for the fleet."""
    from tether.cli.views.fanout import exec_all

    if not all_devices:
        fail("--require picks the devices of --all: add --all")
    if device or always or approve:
        fail("--all runs on every matching device: it does not take --device, --always or --approve")
    try:
        params = parse_assignments(pairs, {})
    except ValueError as exc:
        fail(str(exc))
    command = Command(tool_name=tool, parameters=params, tool_type=tool_type)
    exec_all(command, require, timeout=timeout, max_concurrency=max_concurrency, as_json=as_json, server=server,
             token=token, ca_file=ca_file)


def _schema_for(infos: list[ToolInfo], tool: str, tool_type: str | None) -> dict[str, Any]:
    return next((i.input_schema for i in infos
                 if (i.name == tool or f"{i.namespace}/{i.name}" == tool)
                 and (tool_type is None or i.tool_type == tool_type)), {})


async def _exec_local(tool: str, pairs: list[str], config: Path | None, policy: Path | None, session_id: str,
                      approved_by: str | None, timeout: float | None, tool_type: str | None,
                      state_dir: Path | None, end: bool = False) -> tuple[Result, dict[str, Any]]:
    from tether.cli.mcp_hooks import cli_hooks, configured_llm
    from tether.device.local import open_local_device

    llm = configured_llm()  # sampling is declared to external MCP servers only when there is an LLM
    try:
        async with open_local_device(config, policy_path=policy, state_dir=state_dir,
                               mcp_hooks=cli_hooks(llm)) as device:
            ran = await _exec_on(device, tool, pairs, session_id, approved_by, timeout, tool_type)
            if end:  # the call's own session ends with it (`end_session`: its private /tmp goes)
                await device.dispatcher(session_id=session_id).execute_commands([end_session()], timeout=30)
            return ran
    finally:
        if llm is not None:
            await llm.close()


async def _exec_on(device: LocalDevice, tool: str, pairs: list[str], session_id: str, approved_by: str | None,
                   timeout: float | None, tool_type: str | None) -> tuple[Result, dict[str, Any]]:
    computer = await device.computer_manager.get_or_create(None)
    schema = _schema_for(computer.tool_infos(remove_meta=False), tool, tool_type)
    params = parse_assignments(pairs, schema)
    kind: ToolType | None = tool_type  # type: ignore[assignment]
    command = Command(tool_name=tool, parameters=params, tool_type=kind, timeout=timeout,
                      approved_by=approved_by)
    dispatcher = device.dispatcher(session_id=session_id)
    dispatcher.emit = stream_output
    [result] = await dispatcher.execute_commands([command], timeout=(timeout or 3600) + 5)
    return result, schema


def _allow_always(device: str, tool: str, pairs: list[str], what: str, server: str | None, token: str | None,
                  ca_file: str | None) -> None:
    """The 'always' answer to an approval: the program (or the program with this first argument as its
    only subcommand) goes into the device's allowlist as a remote policy change, before the command runs."""
    from tether.client.rest import RemoteError, RemoteServer
    from tether.tools.policy.command_checks import program_name

    if not tool.startswith(("shell.", "shell_")):
        fail("--always is for shell commands (shell.run, shell_execute)")
    params = parse_assignments(pairs, {})
    name = program_name(params.get("cmd"))
    if name is None:
        fail("--always needs the command's program: cmd=NAME")
    argv = params.get("argv", params.get("args")) or []
    first = next((a for a in argv if isinstance(a, str) and not a.startswith("-")), None)
    if what == "subcommand" and first is None:
        fail("--always subcommand needs a first argument that is not an option (e.g. git status)")
    rule: dict[str, Any] = {"subcommands": [first]} if what == "subcommand" else {}
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            report = remote.set_policy(device, {"commands": {name: rule}})
    except RemoteError as exc:
        fail_remote(exc, ExitCode.FAILED)
    scope = f"{name} {first}" if what == "subcommand" else name
    console(err=True).print(f"{device}: {scope} allowed from now on (policy version {report['version']})",
                            soft_wrap=True)


def _exec_remote(device: str, tool: str, pairs: list[str], session_id: str, approved_by: str | None,
                 timeout: float | None, tool_type: str | None, server: str | None, token: str | None,
                 ca_file: str | None, raw: bool = False, one_off: bool = False) -> tuple[Result, dict[str, Any]]:
    # --timeout is the caller's wall time: the schema lookup spends from the same budget, and the
    # command gets what is left (the batch one second more, so the tool's own timeout, which says
    # what it killed, normally answers first)
    from tether.cli.mcp_hooks import remote_questions
    from tether.client.rest import RemoteError, RemoteServer

    end = time.monotonic() + (timeout or 60)
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            try:
                infos = remote.tools(device, timeout=max(min(end - time.monotonic(), 30), 0.5))
                schema = _schema_for(infos, tool, tool_type)
                params = parse_assignments(pairs, schema)
            except ValueError as exc:
                fail(str(exc))
            left = max(end - time.monotonic(), 0.1)
            command = Command(tool_name=tool, parameters=params, tool_type=tool_type,
                              timeout=left if timeout else None, approved_by=approved_by)
            _, [result] = remote.run(device, [command], timeout=left + (1 if timeout else 5), session_id=session_id,
                                     on_event=remote_questions(remote, device, raw=raw))
            if one_off:  # the call's own session ends with it: the device drops its private /tmp now (an older
                with contextlib.suppress(RemoteError):  # device refuses the meta tool and sweeps it after a day)
                    remote.run(device, [end_session()], session_id=session_id,  # within --timeout's wall time
                               timeout=max(min(end - time.monotonic(), 10), 0.5))
            return result, schema
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
