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

Standard library only: this runs in a fresh interpreter inside the sandbox.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import json
import os
import selectors
import signal
import socket
import stat
import sys
from typing import Any

from tether.sandbox.confine import seccomp
from tether.sandbox.confine.guard import mount_plan
from tether.sandbox.confine.landlock import restrict_writes, scopes
from tether.sandbox.confine.limits import apply_in_command

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
MAX_MESSAGE = 1 << 20
EXEC_FAILED = 127


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _Libc:
    """The few system calls Python 3.11 lacks, checked: a failure raises OSError naming the call."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)

    def _check(self, result: int, what: str) -> int:
        if result == -1:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
        return result

    def clone_namespaces(self) -> int:
        """fork(), but the child is born as pid 1 of a new pid namespace, in a new mount namespace.

        One process per command instead of an unshare()-then-fork() pair: the child is the command.
        The warden is single-threaded, so a raw clone is as safe as fork() here.
        """
        nr = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
        return self._check(self.lib.syscall(nr, ctypes.c_ulong(CLONE_NEWNS | CLONE_NEWPID | signal.SIGCHLD),
                                            None, None, None, None), "clone")

    def mount(self, source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
        def enc(text: str | None) -> bytes | None:
            return None if text is None else os.fsencode(text)

        self._check(self.lib.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
                    f"mount {fstype or 'bind'} on {target}")

    def prctl(self, option: int, arg: int = 0) -> int:
        return self._check(self.lib.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")

    def drop_capabilities(self) -> None:
        """Empty bounding, ambient, effective, permitted and inheritable sets: even uid 0 gets nothing back."""
        for cap in range(64):
            if self.lib.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) == -1:
                if ctypes.get_errno() == 22:  # EINVAL: past the last capability this kernel knows
                    break
                self._check(-1, f"drop capability {cap}")
        self.lib.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)
        header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        self._check(self.lib.capset(ctypes.byref(header), data), "capset")
        self.prctl(PR_SET_NO_NEW_PRIVS, 1)


def _mount_layers(libc: _Libc, req: dict[str, Any]) -> list[str]:
    """The command's view: an overlay per captured root, live roots bound on top, secrets hidden again.

    Everything is opened before anything is mounted, so each overlay's lower layer is the real tree,
    not another overlay. Live roots come from where bwrap bound them for the warden (inside the layers
    directory, not at their own paths: a mount below a captured root would stop its overlay).
    A root with another filesystem mounted inside it on the machine cannot be overlaid (the kernel
    will not hide mounts this namespace did not make): it stays read-only, and the returned note says so.
    """
    notes: list[str] = []
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    live = [(target, os.open(source, os.O_PATH | os.O_DIRECTORY)) for source, target in req.get("live", [])]
    layer = req.get("layer")
    lowers = [(root, os.open(root, os.O_PATH | os.O_DIRECTORY)) for root in layer["roots"]] if layer else []
    for i, (root, fd) in enumerate(lowers):
        upper, work = f"{layer['dir']}/{i}/u", f"{layer['dir']}/{i}/w"  # type: ignore[index]
        plant_whiteouts(upper, root, req.get("hidden", []))
        # volatile: no sync of the upper filesystem when the overlay goes (of the whole filesystem: a journal
        # commit and a disk flush per command otherwise); the device reads the layer through the page cache
        options = f"lowerdir=/proc/self/fd/{fd},upperdir={upper},workdir={work},userxattr,volatile"
        _set_aside(work, req.get("id", 0))
        try:
            libc.mount("overlay", root, "overlay", 0, options)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            notes.append(f"{root} is read-only for this command: a filesystem mounted inside it keeps tether from "
                         "capturing changes there (unmount it, or list the root in live_write_roots to write to it "
                         "directly, uncaptured)")
    for path, fd in live:
        if os.path.isdir(path):
            libc.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
    for _, fd in (*lowers, *live):
        os.close(fd)
    mount_plan(libc.mount, req.get("freeze", []), req.get("readonly", []))  # see sandbox/confine/guard.py
    _hide(libc, req.get("hidden", []))
    if req.get("layers_dir"):
        libc.mount("tmpfs", req["layers_dir"], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=0,mode=0555")
    _mask_sockets(libc, req)
    return notes


def _hide(libc: _Libc, hidden: list[str]) -> None:
    """An empty read-only tmpfs over each hidden directory that exists in this view, /dev/null over each file."""
    for path in hidden:
        # a hidden name that is a symlink (dotfile managers) hides what it points to: mount follows it
        if os.path.isdir(path):
            libc.mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=0,mode=0555")
        elif os.path.exists(path):
            libc.mount("/dev/null", path, None, MS_BIND, None)


def plant_whiteouts(upper: str, root: str, hidden: list[str]) -> None:
    """Each hidden path below the captured `root` that exists: a whiteout (a character device 0/0, which
    needs no capability) at its place in the overlay's upper directory, made before the overlay is
    mounted, so the command's view has no such entry at all (`ls -a ~` does not list `.ssh`, and
    nothing can be read through it). The directories above it are made in the upper with the real
    ones' mode and times (the overlay shows an upper directory's). `layer.scan` never takes a whiteout
    at a hidden path for a deletion; a hidden path the command creates anyway is refused there
    (tools/shell/capture: `hide_paths`). A hidden path below a symlinked directory is left to the
    mount that hides it after the overlay."""
    prefix = root.rstrip("/") + "/"
    for path in hidden:
        if not path.startswith(prefix) or not os.path.lexists(path):
            continue
        parts = path[len(prefix):].split("/")
        made: list[tuple[str, os.stat_result]] = []
        here_upper, here_real = upper, root
        try:
            for part in parts[:-1]:
                here_upper, here_real = f"{here_upper}/{part}", f"{here_real}/{part}"
                real_st = os.lstat(here_real)
                if not stat.S_ISDIR(real_st.st_mode):
                    break
                if not os.path.isdir(here_upper):
                    os.mkdir(here_upper, 0o700)
                    made.append((here_upper, real_st))
            else:
                os.mknod(f"{upper}/{'/'.join(parts)}", stat.S_IFCHR | 0o600, 0)
        except FileExistsError:
            pass  # planted already (a layer kept from an earlier run), or written there by that run
        for where, real_st in reversed(made):  # the innermost first: its own times change its parent's
            os.chmod(where, stat.S_IMODE(real_st.st_mode))
            os.utime(where, ns=(real_st.st_atime_ns, real_st.st_mtime_ns))


def _set_aside(work: str, request_id: int) -> None:
    """A pooled layer's old overlay work directory, renamed to `gone-<request id>` beside it for the device
    to remove later (`Sandbox._sweep`), off the command's clock.

    Mounting over a work directory that has one, the kernel removes it first (freeing disk blocks, which
    some filesystems discard synchronously: milliseconds per directory), and refuses the mount outright
    when a volatile overlay left its marker there (after a crash its upper layer may be incomplete). A
    layer only returns to the pool once its previous command's namespace is gone and its upper layer was
    found empty, so nothing uses the old one any more and the marker says nothing.
    """
    for attempt in range(64):  # gone-<id> is taken when a primed namespace of this layer was dropped unused
        try:
            os.rename(f"{work}/work", f"{work}/gone-{request_id}" + (f"-{attempt}" if attempt else ""))
            return
        except FileNotFoundError:
            return  # a fresh layer
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise


def _mask_sockets(libc: _Libc, req: dict[str, Any]) -> None:
    """The machine's unix sockets the policy did not name, each made /dev/null (a connect is refused),
    and a private, size-capped /dev/shm: nothing one command leaves there is seen by another."""
    if req.get("filters") is False:  # bench.sandbox_filters' baseline only
        return
    for path in req.get("mask_sockets", []):
        try:
            libc.mount("/dev/null", path, None, MS_BIND, None)
        except OSError:
            pass  # gone since the device listed it, or not visible from here (hidden, another mount)
    if req.get("shm") and os.path.isdir("/dev/shm"):
        libc.mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, req["shm"])


def _own_proc(libc: _Libc) -> None:
    """Die with the warden; this pid namespace's own /proc."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)


def _exec_command(libc: _Libc, req: dict[str, Any], exe: int, stdio: list[int]) -> None:
    """pid 1 of the command's pid namespace (its /proc mounted: `_own_proc`): no capabilities, then the
    program itself."""
    filters = req.get("filters") is not False  # false: bench.sandbox_filters' baseline, never the device's
    if filters:
        apply_in_command(req.get("limits") or {})  # pid_max needs this namespace's /proc
    os.setsid()
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    keep = {0, 1, 2, exe}
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass
    os.chdir(req["cwd"])
    libc.drop_capabilities()
    any_socket = bool(req.get("any_socket"))
    if req.get("landlock"):
        # abstract unix sockets and signals scoped to the command (Landlock ABI 6+); ignored before that
        scoped = scopes(req["landlock"], abstract=not any_socket) if filters else 0
        restrict_writes(req["writable"], req["landlock"], scoped=scoped)
    if filters:
        seccomp.prepared(_allows_unix(req), bool(req.get("display"))).install()  # last: nothing after it needs a socket
    argv, env = req["argv"], req["env"]
    # the open file the device checked; a script by its real path (see Sandbox.spawn)
    os.execve(req.get("exec_path") or exe, argv, env)  # noqa: S606 (an argv list, never a shell)


def _allows_unix(req: dict[str, Any]) -> bool:
    return bool(req.get("allow_unix") or req.get("any_socket"))


def _command(libc: _Libc, req: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """The cloned command process: pid 1 of new pid and mount namespaces. Never returns.

    Notes about its confinement go to the device on the warden's socket (one datagram, before the
    warden's own `exit` for this command, which can only follow this process's end).
    """
    exe, *stdio = fds
    try:
        notes = _mount_layers(libc, req)
        if notes:
            sock.send(json.dumps({"op": "note", "id": req["id"], "notes": notes}).encode())
        _own_proc(libc)
        _exec_command(libc, req, exe, stdio)
    except BaseException as exc:
        _could_not_start(req, stdio, exc)
    os._exit(EXEC_FAILED)


def _could_not_start(req: dict[str, Any], stdio: list[int], exc: BaseException) -> None:
    """Tell the command's stderr why it never ran (the device reports exit code 127)."""
    message = f"tether sandbox: could not start {req['argv'][0]}: {exc}\n"
    for fd in (stdio[2], 2):  # stdio[2] is closed once it became fd 2
        try:
            os.write(fd, message.encode("utf-8", "replace"))
            break
        except OSError:
            pass


# What a primed namespace was made for: a `run` whose values of these equal the `prime`'s takes it.
PRIMED_BY = ("layer", "hidden", "live", "layers_dir", "freeze", "readonly", "mask_sockets", "shm", "filters")


def primed_key(req: dict[str, Any]) -> str:
    """The mount-time part of a request (`PRIMED_BY`), as one comparable string."""
    return json.dumps([req.get(k) for k in PRIMED_BY], sort_keys=True)


def _primed(libc: _Libc, req: dict[str, Any], ctl: socket.socket, sock: socket.socket) -> None:
    """A command's namespace made ahead of its request (`prime`): the overlays, masks, /dev/shm and /proc
    mounted, then it waits on `ctl` for the `run` (JSON plus the program's and stdio fds) and goes on
    as `_command` would. Hidden paths that did not exist when it was made are looked at again then, so a
    secret created meanwhile is hidden all the same. `ctl` closed without a word: it exits unused.
    Never returns."""
    try:
        notes = _mount_layers(libc, req)
        _own_proc(libc)
        late = [path for path in req.get("hidden", []) if not os.path.lexists(path)]
    except BaseException as exc:
        sys.stderr.write(f"tether sandbox: could not prepare a command's namespace: {exc}\n")
        os._exit(EXEC_FAILED)
    try:
        data, fds, _, _ = socket.recv_fds(ctl, MAX_MESSAGE, 8)
    except OSError:
        os._exit(0)
    if not data or len(fds) != 4:
        os._exit(0)
    run = json.loads(data)
    exe, *stdio = fds
    try:
        ctl.close()
        if notes:
            sock.send(json.dumps({"op": "note", "id": run["id"], "notes": notes}).encode())
        _hide(libc, late)
        _exec_command(libc, run, exe, stdio)
    except BaseException as exc:
        _could_not_start(run, stdio, exc)
    os._exit(EXEC_FAILED)


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
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.libc = _Libc()
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, tuple[int, int]] = {}  # request id -> (pid, pidfd)
        self.namespaces: dict[int, int] = {}  # request id -> an fd holding its command's mount namespace
        self.ready: dict[str, _Ready] = {}  # layer directory -> the namespace primed on it

    def send(self, message: dict[str, Any]) -> None:
        self.sock.send(json.dumps(message).encode())

    def serve(self) -> None:
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
    libc = _Libc()
    pid = libc.clone_namespaces()
    if pid == 0:
        code = 1
        try:
            req = {"layer": {"dir": base, "roots": [f"{base}/lower"]}, "hidden": [], "live": []}
            _mount_layers(libc, req)
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
