"""The mounts of one sandboxed command's namespace, made by the warden's clone of it (`warden`).

`mount_layers` lays an overlay on every captured write root (writes land in the command's own upper
directory), binds the live roots, applies the freeze plan of `guard`, hides the device's secrets again
on top (an overlay shows its lower tree whole), closes the layers directory, masks the machine's unix
sockets the policy did not name and mounts a private `/dev/shm`; `hold_tmp` and `bind_tmp` give the
command its session's private `/tmp` (`tether.sandbox.private_tmp`); `own_proc` mounts the pid namespace's
own `/proc`. `Libc` is the few system calls Python 3.11 lacks.

Standard library only: this runs in the warden, a fresh interpreter inside the sandbox.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import signal
import stat
from typing import Any

from tether.sandbox.confine.guard import mount_plan

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# the per-mount flags a read-only remount must keep (statvfs's f_flag bits equal these MS_ flags): a flag
# the mount was locked with cannot be cleared in a user namespace
_KEPT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # and MS_NOATIME, MS_NODIRATIME, MS_RELATIME
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class Libc:
    """The few system calls Python 3.11 lacks, checked: a failure raises OSError naming the call."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        # read once, in the warden: a command it clones starts with the same set, and drops these
        self.bounding = bounding_set()

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
        self.drop_bounding()
        self.drop_held()

    def drop_bounding(self) -> None:
        """Empty the bounding set: nothing executed from here on can gain a capability back. What this
        process holds now (effective, permitted) stays until `drop_held`, so it can still mount."""
        for cap in self.bounding:
            if self.lib.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) == -1:
                if ctypes.get_errno() == 22:  # EINVAL: past the last capability this kernel knows
                    break
                self._check(-1, f"drop capability {cap}")

    def drop_held(self) -> None:
        """Empty the ambient, effective, permitted and inheritable sets, and set no_new_privs."""
        self.lib.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)
        header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        self._check(self.lib.capset(ctypes.byref(header), data), "capset")
        self.prctl(PR_SET_NO_NEW_PRIVS, 1)


def bounding_set(status: str = "/proc/self/status") -> list[int]:
    """The capabilities in this process's bounding set (its `CapBnd` line); every number a kernel may know
    (0-63) when that cannot be read."""
    try:
        with open(status, "rb") as f:
            for line in f:
                if line.startswith(b"CapBnd:"):
                    mask = int(line.split()[1], 16)
                    return [cap for cap in range(64) if mask >> cap & 1]
    except (OSError, ValueError, IndexError):
        pass
    return list(range(64))


def mount_layers(libc: Libc, req: dict[str, Any]) -> list[str]:
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
        set_aside(work, req.get("id", 0))
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
    hide(libc, req.get("hidden", []))
    if req.get("layers_dir"):
        libc.mount("tmpfs", req["layers_dir"], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=0,mode=0555")
    mask_sockets(libc, req)
    return notes


@dataclasses.dataclass(slots=True)
class TmpHold:
    """What a command's namespace holds, before its mounts, to give it its session's private /tmp later
    (`bind_tmp`): the sessions' base directory and the kept paths below /tmp, as open fds; the captured
    write roots named below /tmp, opened in the overlaid /tmp when the session's is bound."""

    target: str
    base: int
    keep: list[tuple[str, int, bool]]  # (path, fd, is a directory)
    captured: list[str]
    path: str  # the base's own path below /tmp, hidden from a command given no session's /tmp


def hold_tmp(req: dict[str, Any]) -> TmpHold | None:
    """Open the sessions' private /tmp base (bound at `<layers_dir>/.tmp` for the warden) and the paths
    below /tmp that stay the machine's (`tmp_keep`: [path, where the warden sees it]), before the
    overlays and the closed layers directory hide them. None when the sandbox gives no private /tmp."""
    spec = req.get("private_tmp")
    if not spec:
        return None
    base = os.open(spec["base"], os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    keep = []
    for path, source in spec.get("keep", []):
        try:
            fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # gone since the device listed it
        keep.append((path, fd, stat.S_ISDIR(os.fstat(fd).st_mode)))
    return TmpHold(spec["target"], base, keep, list(spec.get("captured", [])), spec.get("path", ""))


def bind_tmp(libc: Libc, hold: TmpHold | None, run: dict[str, Any]) -> None:
    """Bind the session's own directory (`run["tmp"]`, its name in the base) over /tmp, and the kept paths
    (the captured roots as the overlaid /tmp shows them) back at their places in it; then let go of the held
    fds. A command that captures nothing (`run` has no layer: a read-only command) sees its session's /tmp
    read-only. When `run` names no session's /tmp, the command keeps the captured /tmp of everyone, the
    sessions' base hidden there."""
    if hold is None:
        return
    try:
        name = run.get("tmp")
        if not name:  # the machine's /tmp, captured: every session's /tmp lies in it, hidden
            if hold.path:
                hide(libc, [hold.path])
            return
        if "/" in name or name in (".", ".."):
            raise OSError(f"not a session's /tmp: {name!r}")
        own = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=hold.base)
        for path in hold.captured:  # in the temp dir's overlay (mount_layers): its writes stay captured
            try:
                fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue  # gone since the device listed it
            hold.keep.append((path, fd, True))
        try:
            libc.mount(f"/proc/self/fd/{own}", hold.target, None, MS_BIND, None)
        finally:
            os.close(own)
        if not run.get("layer"):  # nothing of it is captured: it writes nowhere, not even its own /tmp
            kept = os.statvfs(hold.target).f_flag & _KEPT_FLAGS
            libc.mount(None, hold.target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None)
        for path, fd, is_dir in hold.keep:
            _mountpoint(path, is_dir)
            libc.mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
    finally:
        for fd in (hold.base, *(fd for _, fd, _ in hold.keep)):
            os.close(fd)


def _mountpoint(path: str, is_dir: bool) -> None:
    """An empty directory or file at `path` to bind onto, made with the directories above it."""
    os.makedirs(path if is_dir else os.path.dirname(path), mode=0o700, exist_ok=True)
    if not is_dir and not os.path.lexists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))


def hide(libc: Libc, hidden: list[str]) -> None:
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
    ones' mode and times (the overlay shows an upper directory's). `scan.scan` never takes a whiteout
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


def set_aside(work: str, request_id: int) -> None:
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


def mask_sockets(libc: Libc, req: dict[str, Any]) -> None:
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


def own_proc(libc: Libc) -> None:
    """Die with the warden; this pid namespace's own /proc."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
