"""`tether tools`, `tether tools serve` and `tether exec`: locally, or on a device through the server."""

from __future__ import annotations

import asyncio
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
    print_tools,
    run_async,
    tools_app,
)
from tether.cli.guards.root_guard import AllowRootOpt
from tether.protocol.models import ToolInfo

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig


@tools_app.callback()
def tools(ctx: typer.Context, config: ConfigOpt = None, policy: PolicyOpt = None, as_json: JsonOpt = False,
          tool_type: Annotated[str | None, typer.Option("--type", help="data_collection or action")] = None,
          namespace: Annotated[str | None, typer.Option("--namespace", "-n",
                                                                 help="only this namespace's tools")] = None,
          device: DeviceOpt = None, server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None,
          state_dir: StateOpt = None) -> None:
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
    from tether.cli.basics import load_config
    from tether.cli.guards.state_lock import device_state, holding_state_dir

    cfg = load_config(config)  # read once: the state directory and the device
    # its device reads the state directory (kept grants, the sandbox probe) and starts the external MCP servers:
    # one process per state directory; another one-off local call is waited for
    with holding_state_dir(device_state(cfg, state_dir), "tether tools", wait_s=60):
        infos, problems, collisions, disabled = run_async(_list_tools(cfg, policy, tool_type, namespace,
                                                                      state_dir))
    print_tools(infos, as_json)
    if as_json:
        return
    out = console()
    for namespace_name, error in problems.items():
        out.print(f"[yellow]server {escape(namespace_name)} is unavailable:[/yellow] {escape(str(error))}",
                  soft_wrap=True)
    for name in disabled:
        out.print(f"server {name} is disabled in the config (disabled: true): not started", style="dim", markup=False)
    for c in collisions:
        out.print(f"{c['tool']} ({c['tool_type']}) is {c['kept']}'s; {c['shadowed']}'s is {c['use']}", style="dim",
                  markup=False)


async def _list_tools(config: DeviceConfig, policy: Path | None, tool_type: str | None, namespace: str | None,
                      state_dir: Path | None) -> tuple[list[ToolInfo], dict[str, str], list[dict[str, Any]], list[str]]:
    from tether.device.local import open_local_device

    async with open_local_device(config, policy_path=policy, state_dir=state_dir,
                                 lock_state_dir=False) as device:  # `tools` holds it
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
    from tether.cli.guards.state_lock import holding_state_dir
    from tether.tools.context import default_state_dir
    from tether.tools.policy.model import default_policy, load_policy
    from tether.tools.toolsets.builtin import builtin_toolsets

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
    from tether.tools.errors import MissingDependency
    from tether.tools.journal import UndoJournal
    from tether.tools.running.sandboxing import make_sandbox
    from tether.tools.toolsets.mcp_export import serve_http, serve_stdio, toolset_to_mcp

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
    from tether.cli.commands.fleet.exec_run import run_exec  # the body, shared with tether.cli.fast

    run_exec(tool, args, config, policy, as_json, session, approve, always, timeout, tool_type, state_dir, device,
             server, token, ca_file, all_devices, require, max_concurrency, save_dir, raw, allow_root)
