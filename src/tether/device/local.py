"""Assemble a complete device in this process: policy, journal, MCP servers, computers, client.

This is local mode (one machine, one process) and also what `tether device` puts behind its
WebSocket connection, so both paths run exactly the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.device.client import DeviceClient
from tether.device.computer import Computer
from tether.device.computer.manager import ComputerManager
from tether.device.config import DeviceConfig, load_device_config
from tether.device.local_dispatcher import LocalCommandDispatcher
from tether.device.mcp.client.client_caps import ElicitationRequest, MCPClientHooks
from tether.device.mcp.client.manager import MCPServerManager
from tether.device.root import run_as_for
from tether.device.server_programs import with_server_programs
from tether.errors import DeviceError
from tether.sandbox import SandboxInfo, detect
from tether.sandbox.kept import Kept
from tether.tools.context import PersonAsker, ToolContext, default_state_dir
from tether.tools.journal import UndoJournal
from tether.tools.policy.model import Policy, default_policy, load_policy, policy_from_mapping
from tether.tools.running.sandboxing import make_sandbox
from tether.tools.shell.egress_ask import with_grants
from tether.tools.toolsets.builtin import builtin_toolsets


@dataclass
class LocalDevice:
    config: DeviceConfig
    policy: Policy
    state_dir: Path
    journal: UndoJournal
    context: ToolContext
    mcp_server_manager: MCPServerManager
    computer_manager: ComputerManager
    client: DeviceClient

    def dispatcher(self, *, session_id: str | None = None, agent_name: str | None = None,
                   root_name: str | None = None) -> LocalCommandDispatcher:
        return LocalCommandDispatcher(self.client, session_id=session_id, agent_name=agent_name,
                                      root_name=root_name)

    async def aclose(self) -> None:
        try:
            await self.computer_manager.aclose()
            await self.mcp_server_manager.aclose()
        finally:
            if self.context.sandbox is not None:
                await self.context.sandbox.aclose()


def resolve_policy(config: DeviceConfig, policy_path: str | os.PathLike[str] | None = None) -> Policy:
    """An explicit `--policy` file wins, then the config's `device.policy`, then the safe defaults."""
    if policy_path is not None:
        return load_policy(policy_path)
    source = config.device.policy
    if source is None:
        return default_policy()
    if isinstance(source, dict):
        return policy_from_mapping(source, where=f"{config.source or 'device config'}: device.policy")
    base = Path(config.source).parent if config.source else Path.cwd()
    return load_policy(base / Path(source).expanduser())


def policy_file(config: DeviceConfig, policy_path: str | os.PathLike[str] | None = None) -> str | None:
    """The file the device's policy is read from (`--policy`, else the config's `device.policy` when it is
    a path), absolute, or None (inline or the defaults). It decides what every command may do, so the
    sandbox hides it like the config file: a command or file tool that rewrote it would widen the next
    start's rules without a person."""
    if policy_path is not None:
        return os.path.abspath(Path(policy_path).expanduser())
    source = config.device.policy
    if not isinstance(source, str):
        return None
    base = Path(config.source).parent if config.source else Path.cwd()
    return os.path.abspath(base / Path(source).expanduser())


def device_state_dir(config: DeviceConfig, state_dir: str | os.PathLike[str] | None = None) -> Path:
    """`--state-dir`, else the config's `device.state_dir`, else $TETHER_STATE_DIR or ~/.local/state/tether."""
    return Path(state_dir or config.device.state_dir or default_state_dir()).expanduser()


STATE_LOCK = "device.lock"  # in the state directory: held by the one tether process using it


class StateDirBusy(DeviceError):
    """Another live tether process holds the state directory (`hold_state_dir`); the message names it, and
    `holder` says what it is ("tether device", "tether exec", …, or "tether process" when unknown), `pid` its
    process id (None when it has not written it), `directory` the state directory; `starting` is True when the
    holder took the lock an instant ago and has not yet written who it is (a second look, shortly after, names
    it)."""

    def __init__(self, message: str, holder: str = "tether process", *, starting: bool = False,
                 pid: int | None = None, directory: Path | None = None) -> None:
        super().__init__(message)
        self.holder = holder
        self.starting = starting
        self.pid = pid
        self.directory = directory


def hold_state_dir(directory: Path, holder: str = "tether device") -> int:
    """Take this process's exclusive lock on the device state directory `directory` (created 0700 when
    missing) before anything in it is read or written: an `flock` on `<directory>/device.lock`, which also
    holds this process's pid and `holder` (what it is, e.g. "tether run", for another one's refusal). Every
    tether process that uses a state directory takes it (`tether device`, a local `tether run`, `tether exec`,
    `tether tools`, `tether undo`, `tether mcp serve`, `tether tools serve`, and `open_local_device`,
    `open_device` and `serve_device` of the Python API). The lock lasts as long as the returned descriptor
    (close it to give it up) and the kernel drops it however the process ends, kill -9 too, so no stale lock
    is ever left; children do not inherit it (close-on-exec).

    Raises `StateDirBusy` — one line naming the holder (what it is and its pid) and how to run a second one —
    when another process holds it, and `DeviceError` when the directory or its lock file cannot be made or
    opened."""
    path = directory / STATE_LOCK
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        try:  # a read-only state directory: flock needs no write access
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            raise DeviceError(f"cannot lock the state directory {directory}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        pid, what, starting = _holder(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DeviceError(f"cannot lock the state directory {directory}: {exc.strerror or exc}") from None
        who = f"another {what} (pid {pid})" if pid else f"another {what}"
        raise StateDirBusy(f"{who} already uses the state directory {directory} (its undo journal, key and "
                           "token); stop it first, or give this one a state directory of its own: --state-dir DIR "
                           "(or TETHER_STATE_DIR=DIR, or device.state_dir in its config)", what,
                           starting=starting, pid=pid, directory=directory) from None
    record = f"{os.getpid()} {holder}\n".encode()
    with contextlib.suppress(OSError):  # who holds it, for a refusal (best effort: a full disk keeps the lock)
        os.pwrite(fd, record, 0)  # over the last holder's line, then cut: the first line is never empty between
        os.ftruncate(fd, len(record))
    return fd


def hold_state_dir_if_any(directory: Path, holder: str) -> int | None:
    """`hold_state_dir`, but None (nothing held) where the state directory does not exist and cannot be made
    (under a file, a read-only home): no other process can be using it then, so the caller runs without it.

    Raises `StateDirBusy` as `hold_state_dir` does, and `DeviceError` when an existing directory's lock cannot
    be taken."""
    try:
        return hold_state_dir(directory, holder)
    except StateDirBusy:
        raise
    except DeviceError:
        if directory.exists():
            raise
        return None


API_HOLDER = "tether API user"  # what the lock file names a process holding it through the Python API

_HOLDERS = ("tether device", "tether run", "tether run --dry-run", "tether exec", "tether mcp serve",
            "tether tools serve", "tether tools", "tether undo", "tether demo", API_HOLDER)


def _holder(fd: int) -> tuple[int | None, str, bool]:
    """The pid and kind of the process that holds the lock, as it wrote them on the file's first line (a holder
    the file does not name as one of tether's own entry points is called "tether process": the file is never
    echoed as it is), and whether the file is still empty: a holder that has just taken the lock and not yet
    written its line."""
    try:
        line = os.pread(fd, 128, 0).decode().partition("\n")[0].strip()
    except (OSError, UnicodeDecodeError):
        return None, "tether process", False
    if not line:
        return None, "tether process", True
    pid, _, what = line.partition(" ")
    try:
        number = int(pid)
    except ValueError:
        return None, "tether process", False
    return number, what if what in _HOLDERS else "tether device" if not what else "tether process", False


def person_asker(hooks: MCPClientHooks | None) -> PersonAsker | None:
    """How the device's tools ask a person during a call (`ToolContext.ask_person`): the way its external MCP
    servers' questions are asked (`hooks.elicit`: the server's question route when serving, the terminal
    locally); None when the device has none."""
    elicit = hooks.elicit if hooks is not None else None
    if elicit is None:
        return None

    async def ask(question: str, message: str, schema: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        answer = await elicit(ElicitationRequest(id=question, server="tether", call_id=None, session_id=None,
                                                 message=message, schema=schema))
        return answer.action, answer.content

    return ask


def build_device(config: DeviceConfig | None = None, *, policy: Policy | None = None,
                 state_dir: str | os.PathLike[str] | None = None, client_id: str = "local",
                 serving: bool = False, sandbox: bool | SandboxInfo = True,
                 secrets: list[str] | None = None, mcp_hooks: MCPClientHooks | None = None,
                 join_external: bool = False, join_after: asyncio.Event | None = None,
                 on_tools_changed: Callable[[Computer], None] | None = None,
                 only_tool: str | None = None, policy_path: str | os.PathLike[str] | None = None) -> LocalDevice:
    """A device in this process, not started. It does not take the state directory's lock
    (`hold_state_dir`): its caller holds it (`open_local_device`, `open_device` and `tether device` do).

    `serving`: the device runs commands for a server, so a sandbox is required unless the policy says
    otherwise; `sandbox=False` runs processes unconfined (tests of the unconfined path), a `SandboxInfo`
    is a probe already made; `secrets` are more paths the sandbox hides (the token file); `mcp_hooks` answer
    external MCP servers' questions and sampling requests (`mcp.client_caps`); `join_external`: the device
    is ready with its built-in tools and external MCP servers join when they have started (`tether device`
    registers without waiting for them), once `join_after` is set (None: at once), `on_tools_changed`
    hearing of each. `only_tool`: the device runs one command, for this tool (a one-off `tether exec`): the
    built-in tool sets that cannot hold it are not started (`tether.tools.toolsets.builtin.sets_not_holding`).
    `policy_path`: the file `policy` was read from (`--policy`); it, or else the config's `device.policy`
    file, is hidden from every tool like the config file (`policy_file`).

    Raises ValueError for a config, policy or sandbox it cannot use."""
    config = config or load_device_config(None)
    policy = policy or resolve_policy(config)
    # a root device's sandboxes run as an unprivileged user (tether.device.root, docs/security/root.md)
    run_as = run_as_for(config) if sandbox and policy.sandbox else None
    if policy.require_sandbox is None:
        # serving a server, or root told to run commands as another user: no process starts unconfined
        # (as root) because that user's sandbox cannot be made, unless the policy says so explicitly
        policy = policy.model_copy(update={"require_sandbox": serving or run_as is not None})
    # the programs the device itself starts (its stdio MCP servers) wait for a person when changed
    policy = with_server_programs(policy, config)
    root = device_state_dir(config, state_dir)
    if sandbox and policy.sandbox:  # a person's `always` egress grants, kept by an earlier run (sandbox/kept.py)
        policy = with_grants(policy, Kept(root).grants())
    journal = UndoJournal(root)
    source = policy_file(config, policy_path)
    hidden = [str(root), *(secrets or []), *([config.source] if config.source else []), *([source] if source else [])]
    # the probe's answer is kept in the state directory (hidden from sandboxed commands) for this boot
    info = sandbox if isinstance(sandbox, SandboxInfo) else (
        detect(root, run_as=run_as) if sandbox and policy.sandbox else None)
    confined = make_sandbox(policy, hidden=hidden, info=info, run_as=run_as, state_dir=root) \
        if sandbox and policy.sandbox else None
    context = ToolContext(policy=policy, journal=journal, sandbox=confined, secrets=tuple(hidden),
                          ask_person=person_asker(mcp_hooks))
    # its sandbox confines stdio servers; the hooks answer their questions and sampling requests
    servers = MCPServerManager(toolsets=builtin_toolsets(), context=context, hooks=mcp_hooks)
    computers = ComputerManager(config, servers, context=context, join_external=join_external,
                                join_after=join_after, on_tools_changed=on_tools_changed, only_tool=only_tool)
    client = DeviceClient(servers, computers, client_id=config.device.name or client_id)
    return LocalDevice(config, policy, root, journal, context, servers, computers, client)


@asynccontextmanager
async def open_local_device(config: DeviceConfig | str | os.PathLike[str] | None = None, *,
                      policy_path: str | os.PathLike[str] | None = None,
                      state_dir: str | os.PathLike[str] | None = None, sandbox: bool = True,
                      serving: bool = False, mcp_hooks: MCPClientHooks | None = None,
                      only_tool: str | None = None, lock_state_dir: bool = True,
                      holder: str = API_HOLDER) -> AsyncIterator[LocalDevice]:
    """A started device (its default computer's servers open) that is closed on exit.

    `config`: a `DeviceConfig`, a config file, or None (the default one); `policy_path`: a policy file instead
    of the config's; `state_dir`: where its undo journal, kept grants and sandbox probe live (`device_state_dir`);
    `sandbox`, `serving`, `mcp_hooks`, `only_tool`: as `build_device`'s.

    `lock_state_dir` (default): the state directory's lock (`hold_state_dir`) is taken before anything in it is
    read, and held until the device is closed, so that no other tether process (a `tether device`, a local `tether
    exec`, another API user) shares its undo journal, private /tmp base and sessions' totals. False: the caller
    holds it already (as the `tether` commands do). `holder`: what the lock names this process to another one it
    refuses (tether's own entry points name themselves, e.g. "tether demo"). Raises `StateDirBusy` (a `DeviceError`;
    its message names the holder's kind and pid) when another process holds it, `DeviceError` when it cannot be
    taken, and ValueError for a config, policy or sandbox it cannot use; nothing is left running or held then."""
    cfg = config if isinstance(config, DeviceConfig) else load_device_config(config)
    held = hold_state_dir_if_any(device_state_dir(cfg, state_dir), holder) if lock_state_dir else None
    try:
        device = build_device(cfg, policy=resolve_policy(cfg, policy_path), state_dir=state_dir, sandbox=sandbox,
                              serving=serving, mcp_hooks=mcp_hooks, only_tool=only_tool, policy_path=policy_path)
        try:
            await device.computer_manager.get_or_create(None)
            yield device
        finally:
            await device.aclose()
    finally:
        if held is not None:
            os.close(held)
