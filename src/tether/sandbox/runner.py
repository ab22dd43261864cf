"""The device's side of the sandbox: one warm warden, and a process handle per command.

`Sandbox.spawn` sends the warden a `run` request with the program's open file (so what runs is the
file the policy checked, whatever a path inside the sandbox would resolve to) and the command's
stdio pipes; the returned `SandboxedProcess` looks like an asyncio subprocess to the code that
streams output and enforces timeouts. The warden starts on first use and again if it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import shutil
import socket
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from tether.sandbox.confine.bwrap import live_source, unix_socket_paths, warden_argv
from tether.sandbox.confine.guard import LivePlan, live_plan
from tether.sandbox.confine.limits import shm_options
from tether.sandbox.confine.spec import ANY_SOCKET, SandboxSpec, SandboxUnavailable
from tether.sandbox.detect import SandboxInfo
from tether.sandbox.egress.owner import children, command_holding
from tether.sandbox.egress.proxy import Answer, AskFn, EgressProxy, EgressRecord
from tether.sandbox.egress.rules import EgressRules
from tether.sandbox.kept import Kept
from tether.sandbox.layers.held import HeldLayers
from tether.sandbox.layers.layer import discard
from tether.sandbox.layers.session import SessionTotals

logger = logging.getLogger(__name__)
egress_log = logging.getLogger("tether.sandbox.egress")

START_TIMEOUT_S = 15.0
FREE_LAYERS = 8
SWEEP_BATCH = 16  # old overlay work directories removed together, off the event loop (see _sweep)
MAX_REPLY = 1 << 16
_NO_LIVE = LivePlan()  # no live root: nothing to freeze or bind read-only (live_plan would scan for nothing)
PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
NO_PROXY_ENV = ("NO_PROXY", "no_proxy")
# threads that scan, apply and remove layers: a command that made 100,000 files takes one of them, never
# the event loop every other session is served from; more at once wait their turn
CAPTURE_WORKERS = 2
# paths remembered from this device's recent applies, so a conflict between two of its sessions is told
# exactly (not only by ctime, whose coarse clock can lag a change by a tick); older ones are forgotten
APPLIED_LOG_PATHS = 200_000
MAX_HELD_SINCE = 256  # start times kept for layers not yet released, before those of vanished layers are pruned
T = TypeVar("T")



def _x_display(socket_path: str) -> bool:
    """Whether a launched program's display socket is an X server's (/tmp/.X11-unix/X<n>), whose client
    library tries an abstract address first; a Wayland compositor's is reached by its path alone."""
    return os.path.dirname(socket_path) == "/tmp/.X11-unix"

class SandboxedProcess:
    """What `tether.tools.process` needs of a process: pid, pipes, wait() and kill()."""

    def __init__(self, sandbox: Sandbox, request_id: int, pid: int, exited: asyncio.Future[int],
                 stdin: asyncio.StreamWriter | None, stdout: asyncio.StreamReader | None,
                 stderr: asyncio.StreamReader | None) -> None:
        self._sandbox, self._id, self.pid, self._exited = sandbox, request_id, pid, exited
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self.notes: list[str] = []  # what the sandbox has to say about this command's confinement
        self.cpu_s: float | None = None  # CPU seconds the command (and the children it waited for) used

    async def wait(self) -> int:
        self.returncode = await asyncio.shield(self._exited)
        self.notes = self._sandbox._notes.pop(self._id, [])
        self.notes += [r.describe() for r in self._sandbox._connections.pop(self._id, [])]
        self.cpu_s = self._sandbox._cpu.pop(self._id, None)
        return self.returncode

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the process has exited (or its warden is gone)."""
        self._exited.add_done_callback(lambda _: callback())

    def kill(self) -> None:
        """SIGKILL the command's pid namespace: the command and everything it started."""
        if not self._exited.done():
            self._sandbox._send({"op": "kill", "id": self._id})

    async def terminate(self) -> None:
        self.kill()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(START_TIMEOUT_S):
                await self.wait()


class Sandbox:
    """The device's sandbox: owns the warden process; closed with the device."""

    def __init__(self, info: SandboxInfo, spec: SandboxSpec, *, egress: EgressRules | None = None,
                 ask: AskFn | None = None, audit: Callable[[EgressRecord, str], None] | None = None,
                 state_dir: str | os.PathLike[str] | None = None) -> None:
        """`egress`: the host rules of a policy that lists hosts; the spec must then have no network
        (`network=False`), and every command's only way out is the egress proxy, which asks `ask` about
        unlisted hosts (`ask: on-miss`) and reports every connection to `audit` as well as to the log
        and to the command's notes. `state_dir`: the device's state directory, where the sessions' totals
        and a person's `always` grants are kept across restarts (`kept`; None: kept in memory only)."""
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

    @property
    def kind(self) -> str:
        return self.info.kind

    # ----------------------------------------------------------------------------------- warden

    async def _ensure(self) -> socket.socket:
        if self._closed:
            raise SandboxUnavailable("the sandbox is closed (the device is stopping)")
        if self._sock is not None and self._proc is not None and self._proc.returncode is None:
            return self._sock
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._sock is None or self._proc is None or self._proc.returncode is not None:
                await self._start()
        assert self._sock is not None
        return self._sock

    async def _start(self) -> None:
        self._drop_warden("the sandbox restarted")
        os.makedirs(self.spec.layers_dir, mode=0o700, exist_ok=True)
        self._own(Path(self.spec.layers_dir))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8"}
        argv = warden_argv(self.spec, sys.executable, theirs.fileno(), bwrap=self.info.bwrap or "bwrap")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv, pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            ours.close()
            raise SandboxUnavailable(f"could not start bwrap: {exc}") from None
        finally:
            theirs.close()
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                hello = await loop.sock_recv(ours, MAX_REPLY)
        except TimeoutError:
            hello = b""
        if not hello:
            ours.close()
            err = b""
            if self._proc.stderr is not None:
                with contextlib.suppress(TimeoutError):
                    err = await asyncio.wait_for(self._proc.stderr.read(4096), 1.0)
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            detail = err.decode("utf-8", "replace").strip() or "it exited without a word"
            raise SandboxUnavailable(f"the sandbox could not start: {detail}")
        if self.egress is not None:
            try:
                await self._listen(ours)
            except BaseException:
                ours.close()
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                raise
        self._sock = ours
        loop.add_reader(ours.fileno(), self._on_readable)
        asyncio.get_running_loop().create_task(self._log_stderr(self._proc))
        # bwrap → bwrap's init in the new pid namespace → the warden
        self._warden_host_pid = next(iter(children(next(iter(children(self._proc.pid)), 0))), None)
        logger.debug("sandbox warden started (%s, pid %s here)", json.loads(hello), self._warden_host_pid)

    async def _listen(self, sock: socket.socket) -> None:
        """Have the warden open the proxy's port on the sandbox's loopback and serve it with the egress proxy."""
        assert self.egress is not None
        loop = asyncio.get_running_loop()
        sock.setblocking(True)
        try:
            sock.send(json.dumps({"op": "listen"}).encode())
        finally:
            sock.setblocking(False)
        readable: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(sock.fileno(), wake)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await readable
        except TimeoutError:
            raise SandboxUnavailable("the sandbox's warden did not open the egress proxy's port") from None
        finally:
            loop.remove_reader(sock.fileno())
        data, fds, _, _ = socket.recv_fds(sock, MAX_REPLY, 1)
        reply = json.loads(data) if data else {"error": "the warden went away"}
        if reply.get("op") != "listening" or len(fds) != 1 or "error" in reply:
            for fd in fds:
                os.close(fd)
            raise SandboxUnavailable(f"no egress proxy: {reply.get('error', 'unexpected reply from the warden')}")
        self._proxy_port = int(reply["port"])
        self._proxy_task = self.egress.serve(socket.socket(fileno=fds[0]))

    def renetwork(self, network: bool, egress: EgressRules | None) -> None:
        """Follow a changed `network` setting (a server narrowed it, or its change was withdrawn).

        Where the sandbox already has the egress proxy and keeps having no direct network, the new rules
        replace the proxy's at once (off: rules that open nothing): the next connection is judged by
        them, and nothing restarts. Going from direct network to none (or back) needs a new network
        namespace: the warden is restarted on the next command, and the commands running in the old
        one end now (a narrower network applies at once).
        """
        if egress is not None and network:
            raise ValueError("an egress proxy needs a sandbox without direct network (network=False)")
        if self.egress is not None and not network and not self.spec.network:
            self.egress.rules = egress or EgressRules()
            return
        if network == self.spec.network and (egress is None) == (self.egress is None):
            return
        old = self.egress
        self.spec = dataclasses.replace(self.spec, network=network)
        self.egress = None if egress is None else EgressProxy(egress, audit=self._on_connection,
                                                               owner=self._owner_of, ask=self._ask_for)
        self._drop_warden("the sandbox restarted: its network policy changed")
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if old is not None:
            closing = asyncio.get_running_loop().create_task(old.aclose())
            self._removing.add(closing)
            closing.add_done_callback(self._removing.discard)

    def proxy_env(self) -> dict[str, str]:
        """What a command's environment gets so that its HTTP and SOCKS clients use the egress proxy."""
        if self._proxy_port is None:
            return {}
        http = f"http://127.0.0.1:{self._proxy_port}"
        return {**{k: http for k in PROXY_ENV if "all" not in k.lower()},
                "ALL_PROXY": f"socks5h://127.0.0.1:{self._proxy_port}",
                "all_proxy": f"socks5h://127.0.0.1:{self._proxy_port}"}

    async def _ask_for(self, host: str, port: int, owner: int | None) -> Answer | None:
        """`ask: on-miss`: the command's own asker (spawn's `ask`), else the sandbox's; None: nobody to ask."""
        ask = self._askers.get(owner) if owner is not None else None
        ask = ask or self._ask
        return None if ask is None else await ask(host, port, owner)

    def _on_connection(self, record: EgressRecord, event: str) -> None:
        """The audit of one proxied connection: the device's log, the command's notes, the `audit` hook."""
        if event == "open":
            if record.owner is not None and record.owner in self._waiters:
                self._connections.setdefault(record.owner, []).append(record)
            if not record.allowed:
                egress_log.warning("%s", record.describe())
        elif record.allowed:
            egress_log.info("%s", record.describe())
        if self._audit is not None:
            self._audit(record, event)

    async def _owner_of(self, peer: tuple[str, int]) -> int | None:
        """The request id of the command holding the client end `peer` of a proxied connection.

        With one command running it is that one (no other process is left in the sandbox: a command's
        whole pid namespace ends with it). Otherwise its socket's inode is looked up in the warden's
        /proc/net/tcp, and the fds of each command and its descendants — off the event loop, since the
        kernel walks its whole TCP table for that file."""
        running = set(self._warden_pids.values())
        if len(running) <= 1:
            return next(iter(running), None)
        return await asyncio.get_running_loop().run_in_executor(None, self._scan_owner, peer)

    def _scan_owner(self, peer: tuple[str, int]) -> int | None:
        warden = self._warden_host_pid
        if warden is None or not self._warden_pids:
            return None
        holder = command_holding(warden, peer)
        return None if holder is None else self._warden_pids.get(holder)

    async def _log_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            logger.warning("sandbox: %s", line.decode("utf-8", "replace").rstrip())
        await proc.wait()
        if proc is self._proc:
            self._drop_warden(f"the sandbox's warden exited (code {proc.returncode})")

    def _drop_warden(self, why: str) -> None:
        if self._proxy_task is not None:
            self._proxy_task.cancel()
            self._proxy_task = None
            self._proxy_port = None
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for started, exited in self._waiters.values():
            for fut in (started, exited):
                if not fut.done():
                    fut.set_exception(SandboxUnavailable(why))
        self._waiters.clear()
        self._askers.clear()
        self._layer_of.clear()
        if self._primed is not None:  # its namespace went with the warden; the layer is as empty as it was
            layer, _ = self._primed
            self._primed = None
            self._since.pop(layer, None)
            if len(self._free) < FREE_LAYERS:
                self._free.append(layer)

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                data = sock.recv(MAX_REPLY)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._drop_warden("the sandbox's warden went away")
                return
            msg = json.loads(data)
            waiter = self._waiters.get(msg.get("id", -1))
            if waiter is None:
                continue
            started, exited = waiter
            if msg["op"] == "note":
                self._notes.setdefault(msg["id"], []).extend(str(n) for n in msg.get("notes", []))
            elif msg["op"] == "started" and not started.done():
                started.set_result(msg["pid"])
                self._warden_pids[msg["pid"]] = msg["id"]
            elif msg["op"] == "exit":
                self._sweep(msg["id"])
                self._waiters.pop(msg["id"], None)
                self._askers.pop(msg["id"], None)
                self._warden_pids = {p: i for p, i in self._warden_pids.items() if i != msg["id"]}
                if "error" in msg:
                    error = SandboxUnavailable(msg["error"])
                    for fut in (started, exited):
                        if not fut.done():
                            fut.set_exception(error)
                    continue
                if not started.done():
                    started.set_result(0)
                if not exited.done():
                    if msg.get("cpu") is not None:
                        self._cpu[msg["id"]] = float(msg["cpu"])
                    exited.set_result(msg["code"])

    def _send(self, message: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
        if self._sock is None:
            raise SandboxUnavailable("the sandbox's warden is not running")
        data = json.dumps(message).encode()
        self._sock.setblocking(True)
        try:
            socket.send_fds(self._sock, [data], list(fds)) if fds else self._sock.send(data)
        finally:
            self._sock.setblocking(False)

    # ----------------------------------------------------------------------------------- commands

    def new_layer(self) -> Path:
        """A fresh directory for one command's overlays: `<n>/u` and `<n>/w` per captured root.

        A layer a command left empty (most commands write nothing) is reused rather than made anew.
        The time it is handed out is the command's start for `layer_since` (what apply compares with).
        """
        if self._primed is not None:
            layer, self._reserved[layer] = self._primed
            self._primed = None
        else:
            layer = self._free.pop() if self._free else self._make_layer()
        self._since[layer] = (time.time_ns(), self._apply_seq)
        if len(self._since) > 4 * MAX_HELD_SINCE:  # held layers that expired were never released: forget them
            for gone in [known for known in self._since if not known.exists()]:
                del self._since[gone]
        return layer

    def _make_layer(self) -> Path:
        Path(self.spec.layers_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        base = Path(self.spec.layers_dir) / f"L{os.getpid()}-{next(self._layer_ids)}-{os.urandom(4).hex()}"
        base.mkdir(mode=0o700)
        self._own(base)
        for i in range(len(self.spec.write_roots)):
            for sub in (base / str(i), base / str(i) / "u", base / str(i) / "w"):
                sub.mkdir()
                self._own(sub)
        return base

    def _prime(self, layer: Path) -> None:
        """Have the warden make the next command's namespace on the empty `layer` now, between commands
        (warden `_primed`): that command's request then only hands it the program and stdio. A command
        whose mounts differ (another socket list, a changed live root) gets a namespace of its own, as
        before; the primed one is dropped."""
        request_id = next(self._ids)
        try:
            self._send({"op": "prime", "id": request_id, **self._mounts(layer)})
        except (OSError, SandboxUnavailable):
            if len(self._free) < FREE_LAYERS:
                self._free.append(layer)
            return
        self._primed = (layer, request_id)

    def _mounts(self, layer: Path | None, display: tuple[str, ...] = ()) -> dict[str, Any]:
        """The part of a `run` request that decides the command's mounts (warden `PRIMED_BY`), and its IPC
        filters and limits."""
        # live roots are written directly: hidden and protected paths there stay uncreatable
        guard = live_plan(self.spec.live_write_roots, self.spec.hidden, self.spec.protected,
                          self.spec.protected_names, depth=1) if self.spec.live_write_roots else _NO_LIVE
        return {"hidden": [*self.spec.hidden],
                "live": [(live_source(self.spec, i), root) for i, root in enumerate(self.spec.live_write_roots)
                         if self.spec.run_as is None or self.spec.run_as.reaches(root)],
                "layers_dir": self.spec.layers_dir,
                "freeze": guard.freeze, "readonly": guard.readonly,
                "layer": None if layer is None else {"dir": str(layer), "roots": list(self.spec.write_roots)},
                **self._ipc_and_limits(display)}

    def layer_since(self, layer: Path) -> int:
        """When the command writing into `layer` started (wall clock, ns); 0 if unknown."""
        return self._since.get(layer, (0, 0))[0]

    def note_applied(self, paths: Iterable[str], deleted: Iterable[str]) -> None:
        """An apply of this device made changes at `paths` (`deleted`: the ones it removed, trees included).
        Call on the event loop."""
        self._apply_seq += 1
        self._keep_totals()
        entry = (self._apply_seq, frozenset(paths), frozenset(deleted))
        self._applied.append(entry)
        self._applied_paths += len(entry[1])
        while self._applied_paths > APPLIED_LOG_PATHS and self._applied:
            seq, old, _ = self._applied.popleft()
            self._applied_paths -= len(old)
            self._forgotten = seq

    def _keep_totals(self) -> None:
        """Write the sessions' totals to the state directory on the worker pool, one write at a time (a
        change made meanwhile is written once that one ends). Call on the event loop."""
        if self.kept is None or self._closed:
            return
        if self._keeping is not None:
            self._keep_again = True
            return
        self._keeping = self.submit(self.kept.keep_totals, self.sessions.snapshot())

        def done(future: asyncio.Future[None]) -> None:
            self._keeping = None
            if not future.cancelled() and future.exception() is not None:
                logger.warning("could not keep the sessions' totals: %s", future.exception())
            if self._keep_again:
                self._keep_again = False
                self._keep_totals()

        self._keeping.add_done_callback(done)

    def applied_since(self, layer: Path) -> list[tuple[frozenset[str], frozenset[str]]] | None:
        """(paths, deleted) of each apply of this device made after `layer`'s command started; None
        when that is unknown or partly forgotten (ctime alone then tells). Call on the event loop."""
        started = self._since.get(layer)
        if started is None or started[1] < self._forgotten:
            return None
        return [(paths, deleted) for seq, paths, deleted in self._applied if seq > started[1]]

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Start blocking filesystem work (scan, apply, journal) on the sandbox's bounded worker pool."""
        return asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`submit` and wait for it."""
        return await self.submit(fn, *args)

    def _own(self, path: Path) -> None:
        """A root device's layers belong to its run_as user, whose warden mounts overlays on them (a user
        namespace's capabilities reach only files whose owner it maps); see docs/security/root.md."""
        run_as = self.spec.run_as
        if run_as is not None:
            os.chown(path, run_as.uid, run_as.gid, follow_symlinks=False)

    def layer_empty(self, layer: Path) -> bool:
        """Whether the command that wrote into `layer` left nothing there (`layer_empty`, on the loop: an
        empty layer is one directory read per write root; a written one stops at its first entry)."""
        return layer_empty(layer, self.spec.write_roots, self.spec.hidden)

    def release(self, layer: Path, *, empty: bool = False) -> None:
        """Done with a layer: an empty one goes back to the pool, any other is removed off the hot path.
        `empty`: the caller has just found it empty (`layer_empty`), so it is not read again."""
        self._since.pop(layer, None)
        self._reserved.pop(layer, None)
        if len(self._free) < FREE_LAYERS and (empty or self.layer_empty(layer)):
            if self.prime and self._primed is None and self._sock is not None and not self._closed:
                self._prime(layer)
            else:
                self._free.append(layer)
            return
        if self._closed:
            discard(layer)  # the device is stopping: nothing else to serve
            return
        future = asyncio.get_running_loop().run_in_executor(self._pool, discard, layer)
        self._removing.add(future)
        future.add_done_callback(self._removing.discard)

    def _sweep(self, request_id: int) -> None:
        """The command's namespace is gone: the work directories of its layer's previous use, which it set
        aside (`mounts.set_aside`), are removed in batches off the event loop."""
        layer = self._layer_of.pop(request_id, None)
        if layer is None:
            return
        self._gone += [layer / str(i) / "w" / f"gone-{request_id}" for i in range(len(self.spec.write_roots))]
        if len(self._gone) >= SWEEP_BATCH * len(self.spec.write_roots):
            gone, self._gone = self._gone, []
            future = asyncio.get_running_loop().run_in_executor(None, _remove_all, gone)
            self._removing.add(future)
            future.add_done_callback(self._removing.discard)

    async def spawn(self, argv: list[str], *, executable: str, cwd: str, env: dict[str, str],
                    stdin: bool, layer: Path | None, output: bool = True,
                    ask: AskFn | None = None, display_socket: str | None = None,
                    session: str | None = None, session_processes: int = 0) -> SandboxedProcess:
        """Start `argv` (running the file `executable` names, opened here) confined; `layer` captures writes.

        `output=False` sends stdout and stderr to /dev/null (a detached application nobody reads).
        `ask` answers the egress proxy's questions about this command's connections to unlisted hosts
        (`ask: on-miss`), instead of the sandbox's own `ask`. `display_socket`: a launched GUI program's
        X display socket (a real path), which this command alone may connect to beside the policy's
        sockets (and its abstract twin is refused so that libxcb falls back to it: `seccomp.program`).
        `session`, `session_processes`: the session it runs for and that session's process total
        (`SessionTotals.take_processes`: its pid cap is what the session has left, held until it exits;
        `layers.session.SessionLimit` when too little is left, and nothing starts).
        """
        granted = self.sessions.take_processes(session, self.spec.limits.processes, session_processes)
        try:
            process = await self._spawn(argv, executable=executable, cwd=cwd, env=env, stdin=stdin, layer=layer,
                                        output=output, ask=ask, display_socket=display_socket, processes=granted)
        except BaseException:
            self.sessions.give_back_processes(session, granted)
            raise
        if session and session_processes:
            process.on_exit(lambda: self.sessions.give_back_processes(session, granted))
        return process

    async def _spawn(self, argv: list[str], *, executable: str, cwd: str, env: dict[str, str], stdin: bool,
                     layer: Path | None, output: bool, ask: AskFn | None, display_socket: str | None,
                     processes: int) -> SandboxedProcess:
        await self._ensure()
        loop = asyncio.get_running_loop()
        exe = os.open(executable, os.O_PATH | os.O_CLOEXEC)
        to_close = [exe]
        try:
            if not stat.S_ISREG(os.fstat(exe).st_mode):
                raise OSError(f"{executable} is not a regular file")
            exec_path = _script_path(exe, executable)
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
                       "landlock": self.info.landlock,
                       # a script runs by its real path (outside the writable roots, resolved here), so
                       # its interpreter and the script itself find what lies beside it (npm, shims...)
                       "exec_path": exec_path,
                       "writable": [*(self.spec.write_roots if layer is not None else ()),
                                    *self.spec.live_write_roots, "/dev"],
                       **self._mounts(layer, (display_socket,) if display_socket else ())}
            if display_socket and message.get("filters") is not False and _x_display(display_socket):
                message["display"] = True  # libxcb's abstract-address-first connect (seccomp.program)
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
        stdout = await _reader(loop, out_r) if out_r >= 0 else None
        stderr = await _reader(loop, err_r) if err_r >= 0 else None
        writer = await _writer(loop, in_w) if in_w >= 0 else None
        return SandboxedProcess(self, request_id, self._host_pid(pid), exited, writer, stdout, stderr)

    def _ipc_and_limits(self, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """What the warden needs to close IPC and cap resources for one command (see seccomp, limits)."""
        if not self.filters:
            return {"filters": False}
        allowed = (*self.spec.allow_sockets, *extra) if extra else self.spec.allow_sockets
        any_socket = ANY_SOCKET in allowed
        masks: list[str] = []
        if allowed and not any_socket:
            masks = [p for p in unix_socket_paths() if os.path.realpath(p) not in allowed]
        return {"allow_unix": bool(allowed), "any_socket": any_socket, "mask_sockets": masks, **self._limits}

    def _host_pid(self, warden_pid: int) -> int:
        """The pid this machine knows the command by (what `ps` and close_application see), found through
        the warden's children's NSpid lines; 0 if it already exited."""
        warden = self._warden_host_pid
        if warden is None:
            return 0
        for child in children(warden):
            try:
                with open(f"/proc/{child}/status", "rb") as status:
                    for line in status:
                        if line.startswith(b"NSpid:"):
                            ids = line.split()[1:]
                            if len(ids) >= 2 and int(ids[-2]) == warden_pid:
                                return child
                            break
            except OSError:
                continue
        return 0

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
        self._pool.shutdown(wait=False)

    def _discard_layers(self) -> None:
        """The layers this device left, but for those held for an approval (they expire on their own)."""
        layers = Path(self.spec.layers_dir)
        if layers.is_dir():
            for layer in layers.glob(f"L{os.getpid()}-*"):
                if not (layer / "held.json").exists():
                    discard(layer)


def _remove_all(paths: list[Path]) -> None:
    """Remove directories an overlay left (its work directories are mode 000: opened up on the way down),
    with the `<name>-<n>` ones set aside beside them (`mounts.set_aside`)."""
    for path in [*paths, *(aside for named in paths for aside in named.parent.glob(f"{named.name}-*"))]:
        if not path.exists():
            continue
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        for base, dirs, _ in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(base, name), 0o700)
        shutil.rmtree(path, ignore_errors=True)


def layer_empty(layer: Path, roots: int | tuple[str, ...], hidden: tuple[str, ...] = ()) -> bool:
    """Whether the command wrote nothing, checked without a scan: its upper directories are empty, or
    (given the roots by path and the hidden paths) hold nothing but the whiteouts the warden planted over
    hidden paths and the directories above them (`mounts.plant_whiteouts`)."""
    count = roots if isinstance(roots, int) else len(roots)
    try:
        if not hidden or isinstance(roots, int):
            return all(not os.listdir(layer / str(i) / "u") for i in range(count))
        planted = frozenset(hidden)
        return all(_only_planted(str(layer / str(i) / "u"), root.rstrip("/"), planted) for i, root in enumerate(roots))
    except OSError:
        return False


def _only_planted(upper: str, real: str, hidden: frozenset[str]) -> bool:
    with os.scandir(upper) as entries:
        for entry in entries:
            path = f"{real}/{entry.name}"
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0 and path in hidden:
                continue
            above_hidden = stat.S_ISDIR(st.st_mode) and any(h.startswith(path + "/") for h in hidden)
            if above_hidden and os.path.isdir(path) and not os.path.islink(path) and not _opaque(entry.path) \
                    and _only_planted(entry.path, path, hidden):
                continue  # planted only above a real directory; a new one is the command's
            return False
    return True


def _opaque(path: str) -> bool:
    for name in ("user.overlay.opaque", "trusted.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _script_path(fd: int, path: str) -> str | None:
    """The real path of a `#!` script (read through the fd the device opened), None for a binary."""
    try:
        fd_read = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}") if os.pread(fd_read, 2, 0) == b"#!" else None
    finally:
        os.close(fd_read)


async def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


async def _writer(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamWriter:
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(fd, "wb", 0))
    return asyncio.StreamWriter(transport, protocol, None, loop)
