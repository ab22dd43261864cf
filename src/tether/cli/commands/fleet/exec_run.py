"""What `tether exec` does, without typer or click: the command's body (`run_exec`), locally (a device in this
process) or on a device through the server, so that `tether.cli.fast` runs it from a parsed command line at the
cost of what it needs alone. The typer command (`fleet/tools.py`) parses the same options and calls `run_exec`.

Usage errors exit through `SystemExit` (`tether.cli.basics.usage_error`: the words and codes of
`tether.cli.common.fail`); the paths that reach a server or the fleet (`--device`, `--all`) import what they
need when they run, typer included where their views use it."""

from __future__ import annotations

import contextlib
import getpass
import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from tether.cli.basics import (
    ExitCode,
    check_timeout,
    check_tool_type,
    guard_root,
    load_config,
    parse_assignments,
    print_result,
    remote_exit_code,
    remote_message,
    stream_output,
    usage_error,
)
from tether.cli.views.safe_text import console
from tether.protocol.models import Command, Result, ResultStatus, ToolInfo, ToolType

if TYPE_CHECKING:
    from tether.client.rest import RemoteError
    from tether.device.config import DeviceConfig
    from tether.device.local import LocalDevice


def end_session() -> Command:
    """What a one-off call (no --session) tells the device after it: its session has ended, and the device
    drops what it kept for it alone (`Computer.end_session`: the session's private /tmp)."""
    return Command(tool_name="end_session")


def run_exec(tool: str, args: list[str] | None, config: Path | None, policy: Path | None, as_json: bool,
             session: str | None, approve: bool, always: str | None, timeout: float | None, tool_type: str | None,
             state_dir: Path | None, device: str | None, server: str | None, token: str | None,
             ca_file: str | None, all_devices: bool, require: list[str] | None, max_concurrency: int | None,
             save_dir: Path | None, raw: bool, allow_root: bool) -> None:
    """`tether exec` with its options' values (as typer gives them to `fleet/tools.exec_`): run one tool and
    print its structured result. Returns when the result is a success; otherwise `SystemExit` with 1 (a
    failure), `ExitCode.WAITING` (an outcome pending) or the usage error's code (said on stderr)."""
    check_tool_type(tool_type)
    check_timeout(timeout)
    if all_devices or require:
        _exec_all(tool, args or [], all_devices, device, always, approve, require or [], timeout, tool_type,
                  max_concurrency, as_json, server, token, ca_file)
        return
    if always is not None:
        if always not in ("program", "subcommand"):
            usage_error("--always takes program or subcommand")
        if not device:
            usage_error("--always changes a device's policy through its server: give --device")
        _allow_always(device, tool, args or [], always, server, token, ca_file)
    session_id = session or f"cli-{uuid.uuid4().hex[:12]}"
    approved_by = f"cli:{getpass.getuser()}" if approve else None
    one_off = session is None  # a session of this call alone: it ends with it (the device drops its /tmp)
    if device:
        result, schema = _exec_remote(device, tool, args or [], session_id, approved_by, timeout, tool_type,
                                      server, token, ca_file, raw, one_off=one_off)
    else:
        cfg = load_config(config)  # read once: the root guard, the state directory and the device
        guard_root(cfg, allow_root, "tether exec")  # a device in this process (tether.device.root)
        from tether.cli.guards.state_lock import device_state, holding_state_dir

        # one process per state directory; another local one-off call is waited for within --timeout's budget
        with holding_state_dir(device_state(cfg, state_dir), "tether exec", wait_s=timeout or 60):
            result, schema = _run_local(_exec_local(tool, args or [], cfg, policy, session_id, approved_by,
                                                    timeout, tool_type, state_dir, end=one_off))
    if as_json:
        # as typer.echo writes it (ASCII only: json.dumps escapes the rest, control characters included)
        print(json.dumps({"session_id": session_id, "device": device, **result.model_dump(mode="json")}, indent=2),
              flush=True)
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
        raise SystemExit(int(ExitCode.WAITING))
    if result.status is not ResultStatus.SUCCESS:
        raise SystemExit(1)


def _run_local(coro: Any) -> tuple[Result, dict[str, Any]]:
    """`coro` run to its end (`tether.cli.common.run_async`): a configuration or policy file it cannot use
    (ValueError) is a usage error, said in one line."""
    import asyncio

    try:
        result: tuple[Result, dict[str, Any]] = asyncio.run(coro)
    except ValueError as exc:
        usage_error(str(exc))
    return result


def _fail_remote(exc: RemoteError, code: int) -> NoReturn:
    """A server's no as every command says it (`tether.cli.common.fail_remote`)."""
    usage_error(remote_message(exc), remote_exit_code(exc, code))


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
        usage_error("--require picks the devices of --all: add --all")
    if device or always or approve:
        usage_error("--all runs on every matching device: it does not take --device, --always or --approve")
    try:
        params = parse_assignments(pairs, {})
    except ValueError as exc:
        usage_error(str(exc))
    command = Command(tool_name=tool, parameters=params, tool_type=tool_type)
    exec_all(command, require, timeout=timeout, max_concurrency=max_concurrency, as_json=as_json, server=server,
             token=token, ca_file=ca_file)


def _schema_for(infos: list[ToolInfo], tool: str, tool_type: str | None) -> dict[str, Any]:
    return next((i.input_schema for i in infos
                 if (i.name == tool or f"{i.namespace}/{i.name}" == tool)
                 and (tool_type is None or i.tool_type == tool_type)), {})


async def _exec_local(tool: str, pairs: list[str], cfg: DeviceConfig, policy: Path | None, session_id: str,
                      approved_by: str | None, timeout: float | None, tool_type: str | None,
                      state_dir: Path | None, end: bool = False) -> tuple[Result, dict[str, Any]]:
    from tether.cli.local.mcp_hooks import cli_hooks, configured_llm
    from tether.device.local import open_local_device

    # sampling is declared to external MCP servers only, and only when there is an LLM: without such a
    # server the LLM (its settings, its client) is never looked up
    llm = configured_llm() if _external_servers(cfg) else None
    try:
        # a device for this one command: the built-in tool sets that cannot hold the tool are not started
        async with open_local_device(cfg, policy_path=policy, state_dir=state_dir, mcp_hooks=cli_hooks(llm),
                                     only_tool=tool, lock_state_dir=False) as device:  # run_exec holds it
            ran = await _exec_on(device, tool, pairs, session_id, approved_by, timeout, tool_type)
            if end:  # the call's own session ends with it (`end_session`: its private /tmp goes)
                await device.dispatcher(session_id=session_id).execute_commands([end_session()], timeout=30)
            return ran
    finally:
        if llm is not None:
            await llm.close()


def _external_servers(config: DeviceConfig) -> bool:
    """Whether the device config names any external MCP server (one that is not a built-in tool set)."""
    return any(server.toolset is None for agent in config.mcp.values() for root in agent.values()
               for _, server in root.servers())


async def _exec_on(device: LocalDevice, tool: str, pairs: list[str], session_id: str, approved_by: str | None,
                   timeout: float | None, tool_type: str | None) -> tuple[Result, dict[str, Any]]:
    computer = await device.computer_manager.get_or_create(None)
    # the tools before the meta tools, as the registry orders them: a meta tool's schema is built only when no
    # other tool answers to the name (the first match is the same)
    schema = _schema_for(computer.tool_infos(), tool, tool_type) or _schema_for(
        computer.tool_infos(remove_meta=False), tool, tool_type)
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
        usage_error("--always is for shell commands (shell.run, shell_execute)")
    params = parse_assignments(pairs, {})
    name = program_name(params.get("cmd"))
    if name is None:
        usage_error("--always needs the command's program: cmd=NAME")
    argv = params.get("argv", params.get("args")) or []
    first = next((a for a in argv if isinstance(a, str) and not a.startswith("-")), None)
    if what == "subcommand" and first is None:
        usage_error("--always subcommand needs a first argument that is not an option (e.g. git status)")
    rule: dict[str, Any] = {"subcommands": [first]} if what == "subcommand" else {}
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            report = remote.set_policy(device, {"commands": {name: rule}})
    except RemoteError as exc:
        _fail_remote(exc, ExitCode.FAILED)
    scope = f"{name} {first}" if what == "subcommand" else name
    console(err=True).print(f"{device}: {scope} allowed from now on (policy version {report['version']})",
                            soft_wrap=True)


def _exec_remote(device: str, tool: str, pairs: list[str], session_id: str, approved_by: str | None,
                 timeout: float | None, tool_type: str | None, server: str | None, token: str | None,
                 ca_file: str | None, raw: bool = False, one_off: bool = False) -> tuple[Result, dict[str, Any]]:
    # --timeout is the caller's wall time: the schema lookup spends from the same budget, and the
    # command gets what is left (the batch one second more, so the tool's own timeout, which says
    # what it killed, normally answers first)
    from tether.cli.local.mcp_hooks import remote_questions
    from tether.client.rest import RemoteError, RemoteServer

    end = time.monotonic() + (timeout or 60)
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            named: list[str] = []  # the batch's id, once the server has named it (X-Tether-Batch)
            sent = False
            try:
                try:
                    infos = remote.tools(device, timeout=max(min(end - time.monotonic(), 30), 0.5))
                    schema = _schema_for(infos, tool, tool_type)
                    params = parse_assignments(pairs, schema)
                except ValueError as exc:
                    usage_error(str(exc))
                left = max(end - time.monotonic(), 0.1)
                command = Command(tool_name=tool, parameters=params, tool_type=tool_type,
                                  timeout=left if timeout else None, approved_by=approved_by)
                sent = True
                _, [result] = remote.run(device, [command], timeout=left + (1 if timeout else 5),
                                         session_id=session_id, on_event=remote_questions(remote, device, raw=raw),
                                         on_batch=named.append)
            except KeyboardInterrupt:
                _say_interrupted(device, sent, named, remote.base_url)
                raise SystemExit(int(ExitCode.INTERRUPTED)) from None
            if one_off:  # the call's own session ends with it: the device drops its private /tmp now (an older
                with contextlib.suppress(RemoteError):  # device refuses the meta tool and sweeps it after a day)
                    remote.run(device, [end_session()], session_id=session_id,  # within --timeout's wall time
                               timeout=max(min(end - time.monotonic(), 10), 0.5))
            return result, schema
    except RemoteError as exc:
        _fail_remote(exc, ExitCode.USAGE)


def _say_interrupted(device: str, sent: bool, named: list[str], server: str) -> None:
    """One line on stderr for Ctrl-C during a remote command (`sent`: once its batch was being sent): this
    process's connection closes, and the server cancels a batch whose caller went away, on the device too
    (its record and the audit say "cancelled: the HTTP caller disconnected")."""
    import sys

    where = f" --server {server}"
    if not sent:
        line = f"interrupted before the command was sent: nothing ran on device {device}"
    elif named:
        line = (f"interrupted: the server cancels the command on device {device} as its caller went away "
                f"(batch {named[0]}); what it did: tether batch {named[0]}{where}")
    else:
        line = (f"interrupted before the server named the batch: if the command reached device {device}, the "
                f"server cancels it as its caller went away; tether audit --device {device}{where} lists it")
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
