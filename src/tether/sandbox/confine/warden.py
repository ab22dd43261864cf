"""The warden: tether's process inside the sandbox, which starts each command in its own confinement.

Started once per device by `Sandbox` (as `python -I -m tether.sandbox.confine.warden FD` under bubblewrap),
it answers requests on a SOCK_SEQPACKET socket: `run` (JSON plus the program's fd and the stdio fds
as SCM_RIGHTS) and `kill`. Keeping it warm is what makes a sandboxed command cost a fork instead of
a new sandbox and an interpreter. For each command it clones a process into a new mount and pid
namespace — as pid 1 of that namespace — which mounts an overlay on every captured write root
(writes land in the command's own upper directory), hides the device's secrets again on top (an
overlay shows its lower tree whole), mounts its own `/proc` and `/dev/shm`, sets the command's resource
limits (`limits`), drops every capability, shuts IPC out (Landlock scopes, the `seccomp` filter), and executes
the file the device resolved and opened, so no path trick inside the sandbox can change which
program runs. Killing it (SIGKILL from the warden, or PR_SET_PDEATHSIG when the warden dies) takes
its whole pid namespace: nothing it started outlives it.

Between commands it makes the next one's namespace ahead (`prime`, on the layer the device will hand
out next: `_primed`); a `run` whose mount-time inputs equal the prime's (`PRIMED_BY`) takes it, and only
its program, stdio, limits, capabilities, Landlock and seccomp are left on the command's clock.
The command's own process is `command`'s; the mounts themselves are `mounts`'.

Standard library only: this runs in a fresh interpreter inside the sandbox.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import socket
import sys
from typing import Any

from tether.sandbox.confine import seccomp
from tether.sandbox.confine.command import MAX_MESSAGE, _allows_unix, _command, _primed, primed_key
from tether.sandbox.confine.mounts import Libc, mount_layers


@dataclasses.dataclass(slots=True)
class _Ready:
    """A primed namespace waiting for its command (`_primed`): what it was made for (`primed_key`), the
    request id its layer's old work directories went aside under, its process and the warden's holds."""

    key: str
    prime_id: int
    pid: int
    pidfd: int
    ctl: socket.socket
    namespace: int


class Warden:
    """The warden's loop on its socket to the device: `run`, `prime`, `listen` and `kill` requests, each command
    cloned into namespaces of its own (`command`), its start and its exit reported."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.libc = Libc()
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, tuple[int, int]] = {}  # request id -> (pid, pidfd)
        self.namespaces: dict[int, int] = {}  # request id -> an fd holding its command's mount namespace
        self.ready: dict[str, _Ready] = {}  # layer directory -> the namespace primed on it

    def send(self, message: dict[str, Any]) -> None:
        """One JSON datagram to the device."""
        self.sock.send(json.dumps(message).encode())

    def serve(self) -> None:
        """Say `ready`, then serve requests and reap commands until the device closes the socket."""
        self.selector.register(self.sock, selectors.EVENT_READ, None)
        self.send({"op": "ready", "pid": os.getpid()})
        while True:
            for key, _ in self.selector.select():
                if key.data is None:
                    if not self._request():
                        return
                elif isinstance(key.data, str):
                    self._unprime(key.data)  # it died before its command came
                else:
                    self._reap(key.data)

    def _request(self) -> bool:
        data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 8)
        if not data:
            return False
        req = json.loads(data)
        if req["op"] == "run":
            if not self._run_primed(req, data, fds):
                self._run(req, fds)
        elif req["op"] == "prime":
            self._prime(req)
        elif req["op"] == "listen":
            self._listen()
        elif req["op"] == "kill" and req["id"] in self.children:
            try:
                os.kill(self.children[req["id"]][0], signal.SIGKILL)
            except ProcessLookupError:
                pass
        for fd in fds:
            os.close(fd)
        return True

    def _listen(self) -> None:
        """A listening TCP socket on this network namespace's loopback, handed to the device (SCM_RIGHTS).

        The egress proxy (tether.sandbox.egress) accepts from it on the device: the sandbox's only way
        out when its policy lists hosts. The warden keeps no copy, so it stays out of the data path.
        """
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(socket.SOMAXCONN)
            port = listener.getsockname()[1]
            socket.send_fds(self.sock, [json.dumps({"op": "listening", "port": port}).encode()], [listener.fileno()])
        except OSError as exc:
            self.send({"op": "listening", "error": f"could not listen on the sandbox's loopback: {exc}"})
        finally:
            listener.close()

    def _forked(self) -> None:
        """In a freshly cloned process: drop what only the warden may hold (other commands' namespaces,
        the primed ones' control sockets)."""
        for held in self.namespaces.values():  # other commands' namespaces: never kept alive from here
            os.close(held)
        for ready in self.ready.values():
            ready.ctl.close()
            os.close(ready.namespace)

    def _prime(self, req: dict[str, Any]) -> None:
        """`prime`: make the namespace of the next command that will use `req["layer"]` now, between
        commands, so that command's request only has to hand it its program and stdio."""
        layer = (req.get("layer") or {}).get("dir")
        if not layer or layer in self.ready:
            return
        seccomp.prepared(_allows_unix(req), bool(req.get("display")))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = self.libc.clone_namespaces()
        except OSError:
            ours.close()
            theirs.close()
            return  # the command will make its own
        if pid == 0:
            self._forked()
            ours.close()
            _primed(self.libc, req, theirs, self.sock)
        theirs.close()
        pidfd = os.pidfd_open(pid)
        try:
            namespace = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            namespace = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)  # gone already: _unprime reaps it
        self.ready[layer] = _Ready(primed_key(req), int(req.get("id", 0)), pid, pidfd, ours, namespace)
        self.selector.register(pidfd, selectors.EVENT_READ, layer)

    def _unprime(self, layer: str) -> _Ready | None:
        """Drop the namespace primed on `layer`, if any: it exits (or has), its mounts go with it."""
        ready = self.ready.pop(layer, None)
        if ready is None:
            return None
        self.selector.unregister(ready.pidfd)
        ready.ctl.close()  # its recv ends empty: it exits
        try:
            os.waitpid(ready.pid, 0)
        except ChildProcessError:
            pass
        os.close(ready.pidfd)
        os.close(ready.namespace)  # the last hold on its mounts: the layer is free again
        return ready

    def _run_primed(self, req: dict[str, Any], data: bytes, fds: list[int]) -> bool:
        """A `run` on a layer primed for exactly its mounts: handed to that namespace. False when there
        is none (or it went away): the caller makes the command's namespace itself, as before."""
        layer = (req.get("layer") or {}).get("dir")
        ready = self.ready.get(layer) if layer else None
        if ready is None:
            return False
        if ready.key != primed_key(req) or len(fds) != 4:
            self._unprime(layer)  # type: ignore[arg-type]
            return False
        try:
            socket.send_fds(ready.ctl, [data], fds)
        except OSError:
            self._unprime(layer)  # type: ignore[arg-type]
            return False
        del self.ready[layer]  # type: ignore[arg-type]
        ready.ctl.close()
        self.selector.unregister(ready.pidfd)
        if ready.prime_id != req["id"]:  # its old work directories went aside under the prime's id
            for i in range(len(req["layer"]["roots"])):
                try:
                    os.rename(f"{layer}/{i}/w/gone-{ready.prime_id}", f"{layer}/{i}/w/gone-{req['id']}")
                except OSError:
                    pass
        self.children[req["id"]] = (ready.pid, ready.pidfd)
        self.namespaces[req["id"]] = ready.namespace
        self.selector.register(ready.pidfd, selectors.EVENT_READ, req["id"])
        self.send({"op": "started", "id": req["id"], "pid": ready.pid})
        return True

    def _run(self, req: dict[str, Any], fds: list[int]) -> None:
        layer = (req.get("layer") or {}).get("dir")
        if layer:
            self._unprime(layer)  # its overlay would hold the layer's work directory
        seccomp.prepared(_allows_unix(req), bool(req.get("display")))  # made here once, each command installs it
        try:
            pid = self.libc.clone_namespaces()
        except OSError as exc:
            self.send({"op": "exit", "id": req["id"], "error": f"could not make the command's namespaces: {exc}"})
            return
        if pid == 0:
            self._forked()
            _command(self.libc, req, fds, self.sock)
        pidfd = os.pidfd_open(pid)
        self.children[req["id"]] = (pid, pidfd)
        try:  # see _reap: the command's mounts then go after its end is reported, not before
            self.namespaces[req["id"]] = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass  # already gone
        self.selector.register(pidfd, selectors.EVENT_READ, req["id"])
        self.send({"op": "started", "id": req["id"], "pid": pid})

    def _reap(self, request_id: int) -> None:
        pid, pidfd = self.children.pop(request_id)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status, usage = os.wait4(pid, 0)
        self.send({"op": "exit", "id": request_id, "code": os.waitstatus_to_exitcode(status),
                   "cpu": round(usage.ru_utime + usage.ru_stime, 3)})
        # The command's mount namespace lived on in this fd, so its end did not wait for the teardown (the
        # overlays unmounted, each an RCU grace period; its pipes close only after its namespaces are
        # dropped): the teardown happens here, after the device heard of the end, and before this warden
        # reads the next request, so a pooled layer is never mounted twice.
        namespace = self.namespaces.pop(request_id, None)
        if namespace is not None:
            os.close(namespace)


def probe(base: str) -> int:
    """detect()'s check that this machine lets tether do what each command needs: clone into new
    namespaces, mount an overlay, write through it, drop every capability, install the seccomp filter.
    Exit 0, or 1 with why."""
    libc = Libc()
    pid = libc.clone_namespaces()
    if pid == 0:
        code = 1
        try:
            req = {"layer": {"dir": base, "roots": [f"{base}/lower"]}, "hidden": [], "live": []}
            mount_layers(libc, req)
            with open(f"{base}/lower/probe", "w") as f:
                f.write("ok")
            libc.drop_capabilities()
            seccomp.install()  # a kernel without seccomp filters says so here, not at every command
            code = 0
        except BaseException as exc:
            sys.stderr.write(f"{exc}\n")
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    written = os.path.exists(f"{base}/0/u/probe")
    if status == 0 and not written:
        sys.stderr.write("the overlay took no write\n")
    return 0 if status == 0 and written else 1


def main(argv: list[str]) -> int:
    """`--probe BASE`: the probe's exit code (`probe`); else serve the socket whose fd is `argv[1]`: 0 once the
    device has closed it."""
    if len(argv) == 3 and argv[1] == "--probe":
        return probe(argv[2])
    sock = socket.socket(fileno=int(argv[1]))
    try:
        Warden(sock).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
