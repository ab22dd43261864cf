"""The device's side of the sandbox: one warm warden, and a process handle per command.

`Sandbox.spawn` sends the warden a `run` request with the program's open file (so what runs is the
file the policy checked, whatever a path inside the sandbox would resolve to) and the command's
stdio pipes; the returned `SandboxedProcess` looks like an asyncio subprocess to the code that
streams output and enforces timeouts. The warden starts on first use and again if it dies."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import stat
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tether.sandbox.confine.limits import shm_options
from tether.sandbox.confine.spec import SandboxSpec, SandboxUnavailable
from tether.sandbox.detect import SandboxInfo
from tether.sandbox.egress.proxy import AskFn, EgressProxy, EgressRecord
from tether.sandbox.egress.rules import EgressRules
from tether.sandbox.kept import Kept
from tether.sandbox.layers.held import HeldLayers
from tether.sandbox.layers.session import SessionTotals
from tether.sandbox.private_tmp import IDLE_S, PrivateTmp, session_key
from tether.sandbox.runner.egress import EgressSide
from tether.sandbox.runner.layers import LayerBook
from tether.sandbox.runner.process import SandboxedProcess, pipe_reader, pipe_writer, script_path
from tether.sandbox.runner.requests import Requests, x_display
from tether.sandbox.runner.state import (
    CAPTURE_WORKERS,
    NO_PROXY_ENV,
    START_TIMEOUT_S,
)
from tether.sandbox.runner.warden import WardenClient


class Sandbox(WardenClient, LayerBook, Requests, EgressSide):
    """The device's sandbox: owns the warden process; closed with the device."""

    def __init__(self, info: SandboxInfo, spec: SandboxSpec, *, egress: EgressRules | None = None,
                 ask: AskFn | None = None, audit: Callable[[EgressRecord, str], None] | None = None,
                 state_dir: str | os.PathLike[str] | None = None, tmp_idle_s: float = IDLE_S) -> None:
        """`egress`: the host rules of a policy that lists hosts; the spec must then have no network
        (`network=False`), and every command's only way out is the egress proxy, which asks `ask` about
        unlisted hosts (`ask: on-miss`) and reports every connection to `audit` as well as to the log
        and to the command's notes. `state_dir`: the device's state directory, where the sessions' totals
        and a person's `always` grants are kept across restarts (`kept`; None: kept in memory only).
        `tmp_idle_s`: how long a session's private /tmp outlives its last use (`private_tmp`)."""
        if egress is not None and spec.network:
            raise ValueError("an egress proxy needs a sandbox without direct network (network=False)")
        if not info.available or not info.bwrap:
            raise SandboxUnavailable(info.detail)
        if not spec.layers_dir:
            raise SandboxUnavailable("the sandbox needs a layers directory outside the write roots")
        self.info, self.spec = info, spec
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._starting: asyncio.Lock | None = None
        self._waiters: dict[int, tuple[asyncio.Future[int], asyncio.Future[int]]] = {}
        self._ids = itertools.count(1)
        self._layer_ids = itertools.count(1)
        self._closed = False
        self.held = HeldLayers(Path(spec.layers_dir))
        self.kept = None if state_dir is None else Kept(state_dir)
        # what each session's commands applied, all together (layers/session.py), as an earlier run left it
        self.sessions = SessionTotals(rows=self.kept.totals() if self.kept is not None else ())
        self._keeping: asyncio.Future[None] | None = None  # the totals being written to the state directory
        self._keep_again = False  # they changed while being written
        self._free: list[Path] = []
        # an empty layer the warden has already mounted the next command's namespace on (`_prime`), with
        # the request id reserved for that command; handed out first by new_layer
        self._primed: tuple[Path, int] | None = None
        self._reserved: dict[Path, int] = {}  # a primed layer handed out -> its reserved request id
        self._layer_of: dict[int, Path] = {}  # request id -> the layer its command mounted
        self._gone: list[Path] = []  # old overlay work directories the warden set aside, to be removed
        self._warden_host_pid: int | None = None
        self._notes: dict[int, list[str]] = {}
        self._cpu: dict[int, float] = {}
        self._removing: set[asyncio.Future[None]] = set()
        self._audit = audit
        self._ask = ask
        self._askers: dict[int, AskFn] = {}  # request id -> who answers for that command (spawn's `ask`)
        self.egress = None if egress is None else EgressProxy(egress, audit=self._on_connection,
                                                               owner=self._owner_of, ask=self._ask_for)
        self._proxy_port: int | None = None
        self._proxy_task: asyncio.Task[None] | None = None
        self._connections: dict[int, list[EgressRecord]] = {}  # request id -> its connections, for its notes
        self._warden_pids: dict[int, int] = {}  # the warden's pid of a running command -> its request id
        # the IPC filters and resource limits (seccomp, Landlock scopes, socket masks, rlimits, /dev/shm):
        # always on for a device; bench.sandbox_filters turns them off to measure what they cost
        self.filters = True
        # each command's namespace made ahead, on the layer its predecessor left empty (`_prime`): always on
        # for a device; bench.sandbox_filters turns it off to measure what it saves
        self.prime = True
        self._limits = {"limits": spec.limits.to_request(), "shm": shm_options(spec.limits)}  # the same each time
        self._pool = ThreadPoolExecutor(max_workers=CAPTURE_WORKERS, thread_name_prefix="tether-capture")
        self._since: dict[Path, tuple[int, int]] = {}  # layer -> (wall clock ns, apply seq) at its command's start
        self._applied: deque[tuple[int, frozenset[str], frozenset[str]]] = deque()
        self._applied_paths = 0
        self._apply_seq = 0
        self._forgotten = 0  # the newest apply dropped from the log
        # each session's own /tmp, where the temp dir is a captured root (tether.sandbox.private_tmp)
        self.private_tmp = private_tmp_of(spec, tmp_idle_s, state_dir)
        self._tmp_sweep: asyncio.Future[list[str]] | None = None  # the last sweep of ended sessions' /tmp

    @property
    def kind(self) -> str:
        return self.info.kind

    async def spawn(self, argv: list[str], *, executable: str, cwd: str, env: dict[str, str],
                    stdin: bool, layer: Path | None, output: bool = True,
                    ask: AskFn | None = None, display_socket: str | None = None,
                    session: str | None = None, session_processes: int = 0,
                    session_tmp: bool = True) -> SandboxedProcess:
        """Start `argv` (running the file `executable` names, opened here) confined; `layer` captures writes.

        `output=False` sends stdout and stderr to /dev/null (a detached application nobody reads).
        `ask` answers the egress proxy's questions about this command's connections to unlisted hosts
        (`ask: on-miss`), instead of the sandbox's own `ask`. `display_socket`: a launched GUI program's
        X display socket (a real path), which this command alone may connect to beside the policy's
        sockets (and its abstract twin is refused so that libxcb falls back to it: `seccomp.program`).
        `session`, `session_processes`: the session it runs for and that session's process total
        (`SessionTotals.take_processes`: its pid cap is what the session has left, held until it exits;
        `layers.session.SessionLimit` when too little is left, and nothing starts). `session_tmp`: the command
        sees its session's private /tmp (where the sandbox gives sessions one; read-only for a command that
        captures nothing); False: the machine's, read-only, the sessions' directories hidden there (a
        program that outlives the session, such as a launched application).
        """
        granted = self.sessions.take_processes(session, self.spec.limits.processes, session_processes)
        try:
            process = await self._spawn(argv, executable=executable, cwd=cwd, env=env, stdin=stdin, layer=layer,
                                        output=output, ask=ask, display_socket=display_socket, processes=granted,
                                        session=session,
                                        own_tmp=session_tmp)
        except BaseException:
            self.sessions.give_back_processes(session, granted)
            raise
        if session and session_processes:
            process.on_exit(lambda: self.sessions.give_back_processes(session, granted))
        return process

    async def _spawn(self, argv: list[str], *, executable: str, cwd: str, env: dict[str, str], stdin: bool,
                     layer: Path | None, output: bool, ask: AskFn | None, display_socket: str | None,
                     processes: int, session: str | None, own_tmp: bool) -> SandboxedProcess:
        await self._ensure()  # first: its start sweeps the private /tmp an earlier run's ended sessions left
        tmp = self._session_tmp(session) if layer is not None or own_tmp else None
        loop = asyncio.get_running_loop()
        exe = os.open(executable, os.O_PATH | os.O_CLOEXEC)
        to_close = [exe]
        try:
            if not stat.S_ISREG(os.fstat(exe).st_mode):
                raise OSError(f"{executable} is not a regular file")
            exec_path = script_path(exe, executable)
            if exec_path is not None and tmp is not None:  # a script in the session's /tmp: where it sees it
                exec_path = self.unmap_tmp(session, exec_path)
            in_r, in_w = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
            out_r, out_w = os.pipe() if output else (-1, os.open(os.devnull, os.O_WRONLY))
            err_r, err_w = os.pipe() if output else (-1, os.open(os.devnull, os.O_WRONLY))
            to_close += [in_r, out_w, err_w]
            request_id = (self._reserved.pop(layer, None) if layer is not None else None) or next(self._ids)
            started: asyncio.Future[int] = loop.create_future()
            exited: asyncio.Future[int] = loop.create_future()
            self._waiters[request_id] = (started, exited)
            if ask is not None:
                self._askers[request_id] = ask
            message = {"op": "run", "id": request_id, "argv": argv, "cwd": cwd, "env": env,
                       # a script runs by its real path (outside the writable roots, resolved here), so
                       # its interpreter and the script itself find what lies beside it (npm, shims...)
                       "exec_path": exec_path,
                       **self._mounts(layer, (display_socket,) if display_socket else (), own_tmp=tmp is not None)}
            if display_socket and message.get("filters") is not False and x_display(display_socket):
                message["display"] = True  # libxcb's abstract-address-first connect (seccomp.program)
            if tmp is not None:
                message["tmp"] = tmp  # the session's own /tmp (mounts.bind_tmp)
            if "limits" in message and processes != message["limits"].get("processes"):  # a session's share
                message["limits"] = {**message["limits"], "processes": processes}
            if self.egress is not None:
                env = {k: v for k, v in env.items() if k not in NO_PROXY_ENV} | self.proxy_env()
                message["env"] = env
            self._send(message, [exe, in_r, out_w, err_w])
            if layer is not None:
                self._layer_of[request_id] = layer
        finally:
            for fd in to_close:
                os.close(fd)
        try:
            # not wait_for: on 3.11 it can swallow a cancellation that arrives as `started` resolves, and the
            # caller's timeout (a 50 ms timeoutMs) would then be lost and the command run to its end
            async with asyncio.timeout(START_TIMEOUT_S):
                pid = await asyncio.shield(started)
        except BaseException:
            with contextlib.suppress(Exception):  # the warden handles the run first: it cannot outlive us
                self._send({"op": "kill", "id": request_id})
            for fd in (in_w, out_r, err_r):
                if fd >= 0:
                    os.close(fd)
            raise
        stdout = await pipe_reader(loop, out_r) if out_r >= 0 else None
        stderr = await pipe_reader(loop, err_r) if err_r >= 0 else None
        writer = await pipe_writer(loop, in_w) if in_w >= 0 else None
        return SandboxedProcess(self, request_id, self._host_pid(pid), exited, writer, stdout, stderr)

    def _session_tmp(self, session: str | None) -> str | None:
        """The name of `session`'s private /tmp directory in the base, made and touched now (None: the
        command sees the captured /tmp of everyone: no session, or no private /tmp here). A session's
        first use sweeps the directories of sessions idle too long, off the event loop."""
        private = self.private_tmp
        if private is None or not session:
            return None
        fresh = not private.knows(session)
        try:
            private.dir_of(session)
        except OSError as exc:
            raise SandboxUnavailable(f"the session's private /tmp could not be made: {exc}") from None
        if fresh:
            sweep = self._tmp_sweep = self.submit(private.sweep)
            self._removing.add(sweep)  # type: ignore[arg-type]
            sweep.add_done_callback(self._removing.discard)
        return session_key(session)

    async def end_session(self, session: str) -> bool:
        """`session` has ended: its private /tmp is removed now, off the event loop. Whether it had one here."""
        private = self.private_tmp
        if private is None or not session:
            return False
        return await self.offload(private.remove, session)

    def live_hidden(self) -> tuple[str, ...]:
        """What a live process (`bwrap.live_argv`: a sandboxed MCP server, which sees the machine's /tmp)
        must not reach beside the spec's hidden paths: the sessions' private /tmp base, where there is one."""
        if self.private_tmp is None:
            return ()
        try:
            return (self.private_tmp.base,)
        except OSError:  # it cannot be made: then no session has one either
            return ()

    def map_tmp(self, session: str | None, path: str) -> str:
        """Where a file tool's `path` leads for `session`: into the session's private /tmp for a path below
        the temp dir, as its commands see it (`PrivateTmp.map`), else `path` itself."""
        return path if self.private_tmp is None else self.private_tmp.map(session, path)

    def unmap_tmp(self, session: str | None, resolved: str) -> str:
        """Where a sandboxed command of `session` sees the real path `resolved` (`PrivateTmp.unmap`)."""
        return resolved if self.private_tmp is None else self.private_tmp.unmap(session, resolved)

    def foreign_tmp(self, session: str | None, resolved: str) -> bool:
        """Whether the real path `resolved` lies in another session's private /tmp (`PrivateTmp.foreign`)."""
        return self.private_tmp is not None and self.private_tmp.foreign(session, resolved)

    async def aclose(self) -> None:
        self._closed = True
        self.held.clear()
        self._drop_warden("the sandbox is closed (the device is stopping)")
        if self.egress is not None:
            await self.egress.aclose()
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), START_TIMEOUT_S)
        if self._removing:
            await asyncio.gather(*self._removing, return_exceptions=True)
        if self._keeping is not None:
            await asyncio.gather(self._keeping, return_exceptions=True)
        if self.kept is not None and self._keep_again:  # changed during the last write: the final state
            self._keep_again = False
            with contextlib.suppress(Exception):
                await self.offload(self.kept.keep_totals, self.sessions.snapshot())
        self._free.clear()
        with contextlib.suppress(RuntimeError):  # closed twice: the pool is already shut down
            await self.offload(self._discard_layers)
            if self.private_tmp is not None:  # its base goes with it when no session is left in it
                await self.offload(self.private_tmp.close)
        self._pool.shutdown(wait=False)


def private_tmp_of(spec: SandboxSpec, idle_s: float,
                   state_dir: str | os.PathLike[str] | None = None) -> PrivateTmp | None:
    """The sessions' private /tmp directories of a sandbox whose spec asks for them (`private_tmp`) and whose
    captured write roots include the temp dir, their base recorded in the device's `state_dir` (None: not
    recorded, each run makes its own); None otherwise (/tmp is then one captured root of every session,
    read-only, or a live root). The live roots, captured write roots and sockets the policy names below the
    temp dir stay the machine's own (the captured ones still captured, through the temp dir's overlay)."""
    tmp = os.path.realpath(tempfile.gettempdir())
    if not spec.private_tmp or tmp not in {os.path.realpath(root) for root in spec.write_roots}:
        return None
    below = [p for p in (*spec.live_write_roots, *spec.allow_sockets) if p.startswith(tmp + "/")]
    captured = [p for p in spec.tmp_roots if p.startswith(tmp + "/")]
    owner = None if spec.run_as is None else (spec.run_as.uid, spec.run_as.gid)
    return PrivateTmp(tmp, state_dir, owner=owner, keep=(*below, *captured), captured=tuple(captured),
                      idle_s=idle_s)
