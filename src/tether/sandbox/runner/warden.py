"""The warden's client: starting it, its socket protocol (requests out, notes, starts and exits in),
and what is dropped when it goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from tether.sandbox.confine.bwrap import warden_argv
from tether.sandbox.confine.spec import SandboxUnavailable
from tether.sandbox.egress.owner import children
from tether.sandbox.runner.state import (
    FREE_LAYERS,
    MAX_REPLY,
    START_TIMEOUT_S,
    SandboxParts,
    logger,
)


class WardenClient(SandboxParts):
    """The `Sandbox`'s side of the warden's socket."""

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
        tmp_base = None
        if self.private_tmp is not None:
            try:
                tmp_base = self.private_tmp.base  # made (or found again) before the warden binds it
            except OSError as exc:
                raise SandboxUnavailable(f"the sessions' private /tmp could not be made: {exc}") from None
            # what an earlier run's ended sessions left, before any command of this one runs
            await self.offload(self.private_tmp.sweep)
            # and what devices that are gone left in the temp dir: bases no living process holds
            await self.offload(self.private_tmp.sweep_bases)
        argv = warden_argv(self.spec, sys.executable, theirs.fileno(), bwrap=self.info.bwrap or "bwrap",
                           tmp_base=tmp_base)
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
