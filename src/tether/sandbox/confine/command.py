"""A command's own process, cloned by the warden (`warden`) as pid 1 of new pid and mount namespaces: its
mounts (`mounts`), its resource limits, an empty bounding set and the seccomp filter (`_confine_early`), its
Landlock ruleset, and then its program (`_exec_command`). `_command` does it all when the request comes;
`_primed` mounts and confines ahead of the request, for the next command on a layer (`PRIMED_BY`,
`primed_key`), and waits for its run. Neither returns: the program runs, or the process exits `EXEC_FAILED`
having told the command's stderr why.

Standard library only: this runs in the warden's fresh interpreter inside the sandbox.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

from tether.sandbox.confine import seccomp
from tether.sandbox.confine.landlock import restrict_self, restrict_writes, scopes, write_ruleset
from tether.sandbox.confine.limits import apply_in_command
from tether.sandbox.confine.mounts import Libc, bind_tmp, hide, hold_tmp, mount_layers, own_proc

MAX_MESSAGE = 1 << 20
MAX_FD = (1 << 31) - 1  # os.closerange's end: past any fd
EXEC_FAILED = 127


def _confine_early(libc: Libc, req: dict[str, Any]) -> None:
    """The part of a command's confinement that needs nothing of its `run` beyond what a primed namespace
    was made for (`PRIMED_BY`), so `_primed` does it before the request comes: the resource limits (pid_max
    needs this namespace's /proc: after `own_proc`), an empty bounding set (what the process holds now stays
    until `_exec_command`: it still mounts), and the seccomp filter (it refuses only sockets, io_uring and a
    display's abstract connect: nothing done from here to the program's `exec` makes one)."""
    filters = req.get("filters") is not False  # false: bench.sandbox_filters' baseline, never the device's
    if filters:
        apply_in_command(req.get("limits") or {})
    libc.drop_bounding()
    if filters:
        seccomp.prepared(_allows_unix(req), bool(req.get("display"))).install()


def _landlock_ahead(req: dict[str, Any]) -> int | None:
    """In a primed namespace: the command's Landlock ruleset made now (its rules name the overlays mounted
    here), for `_exec_command` to apply; None when it must wait for the run (no Landlock, or the session's
    private /tmp, bound only then, would not be what a rule made now names)."""
    if not req.get("landlock") or req.get("private_tmp") or req.get("writable") is None:
        return None
    return write_ruleset(req["writable"], req["landlock"], scoped=_scoped(req))


def _scoped(req: dict[str, Any]) -> int:
    """The Landlock IPC scopes of a command: abstract unix sockets (unless any socket is allowed) and signals."""
    if req.get("filters") is False:  # bench.sandbox_filters' baseline, never the device's
        return 0
    return scopes(req["landlock"], abstract=not req.get("any_socket"))


def _exec_command(libc: Libc, req: dict[str, Any], exe: int, stdio: list[int], ruleset: int | None = None) -> None:
    """pid 1 of the command's pid namespace, its /proc mounted (`own_proc`) and `_confine_early` done: its
    own process group, its stdio, no capabilities, Landlock (after the last mount: a Landlock domain may not
    mount; `ruleset` when `_landlock_ahead` made it), then the program itself."""
    # a process group of its own, in the warden's session (which has no terminal: bwrap --new-session);
    # not a session of its own: setsid() would also put it in a new scheduler autogroup, which on a busy
    # machine costs the command milliseconds waiting for its first turn
    os.setpgid(0, 0)
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    _close_all_but({0, 1, 2, exe} if ruleset is None else {0, 1, 2, exe, ruleset})
    os.chdir(req["cwd"])
    libc.drop_held()
    if ruleset is not None:
        restrict_self(ruleset)  # abstract unix sockets and signals scoped too (Landlock ABI 6+)
        os.close(ruleset)
    elif req.get("landlock"):
        restrict_writes(req["writable"], req["landlock"], scoped=_scoped(req))
    argv, env = req["argv"], req["env"]
    # the open file the device checked; a script by its real path (see Sandbox.spawn)
    os.execve(req.get("exec_path") or exe, argv, env)  # noqa: S606 (an argv list, never a shell)


def _close_all_but(keep: set[int]) -> None:
    """Close every other fd: one close_range call per gap between the kept ones."""
    low = 0
    for fd in sorted(keep):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, MAX_FD)


def _allows_unix(req: dict[str, Any]) -> bool:
    return bool(req.get("allow_unix") or req.get("any_socket"))


def _command(libc: Libc, req: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """The cloned command process: pid 1 of new pid and mount namespaces. Never returns.

    Notes about its confinement go to the device on the warden's socket (one datagram, before the
    warden's own `exit` for this command, which can only follow this process's end).
    """
    exe, *stdio = fds
    try:
        tmp = hold_tmp(req)
        notes = mount_layers(libc, req)
        bind_tmp(libc, tmp, req)
        if notes:
            sock.send(json.dumps({"op": "note", "id": req["id"], "notes": notes}).encode())
        own_proc(libc)
        _confine_early(libc, req)
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
# The limits, what decides the seccomp filter (allow_unix, any_socket, display) and the Landlock ruleset
# (writable, landlock) are made in the primed namespace ahead too (`_confine_early`, `_landlock_ahead`).
PRIMED_BY = ("layer", "hidden", "live", "layers_dir", "freeze", "readonly", "mask_sockets", "shm", "filters",
             "private_tmp", "limits", "allow_unix", "any_socket", "display", "writable", "landlock")


def primed_key(req: dict[str, Any]) -> str:
    """The mount-time part of a request (`PRIMED_BY`), as one comparable string."""
    return json.dumps([req.get(k) for k in PRIMED_BY], sort_keys=True)


def _primed(libc: Libc, req: dict[str, Any], ctl: socket.socket, sock: socket.socket) -> None:
    """A command's namespace made ahead of its request (`prime`): the overlays, masks, /dev/shm and /proc
    mounted, then it waits on `ctl` for the `run` (JSON plus the program's and stdio fds) and goes on
    as `_command` would. Hidden paths that did not exist when it was made are looked at again then, so a
    secret created meanwhile is hidden all the same. `ctl` closed without a word: it exits unused.
    Never returns."""
    try:
        tmp = hold_tmp(req)  # the session's /tmp is only known with the run: bound then
        notes = mount_layers(libc, req)
        own_proc(libc)
        _confine_early(libc, req)
        ruleset = _landlock_ahead(req)
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
        hide(libc, late)
        bind_tmp(libc, tmp, run)
        _exec_command(libc, run, exe, stdio, ruleset)
    except BaseException as exc:
        _could_not_start(run, stdio, exc)
    os._exit(EXEC_FAILED)
