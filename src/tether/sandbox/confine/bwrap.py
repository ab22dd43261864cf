"""The bubblewrap command lines tether runs: the warden's (a warm sandbox) and a plain one for live processes.

Both share one base: a new user, pid, ipc, uts and cgroup namespace (network too when the policy
turns it off), the whole machine read-only, a private `/proc` and `/dev`, a new session (no
TIOCSTI into the device's terminal), and `--die-with-parent`, so nothing outlives the device.
Hidden paths come last, so a hidden path inside a writable root stays hidden.
"""

from __future__ import annotations

import os
import stat
import sys

from tether.sandbox.confine.guard import live_plan
from tether.sandbox.confine.spec import ANY_SOCKET, SandboxSpec, under


def _base(bwrap: str, spec: SandboxSpec) -> list[str]:
    # a root device starts bwrap as its run_as user (tether.sandbox.confine.run_as): then the sandbox's user
    # namespace maps that user, not root, and root-only files stay unreadable
    prefix = spec.run_as.argv_prefix() if spec.run_as is not None else []
    args = [*prefix, bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    if not spec.network:
        args.append("--unshare-net")
    return args


def hide_args(spec: SandboxSpec, *, skip_under: tuple[str, ...] = ()) -> list[str]:
    """An empty read-only directory over each hidden directory, /dev/null over each hidden file."""
    args: list[str] = []
    for path in spec.hidden:
        if under(path, skip_under):
            continue
        target = os.path.realpath(path)  # a hidden symlink hides what it points to
        if spec.run_as is not None and not spec.run_as.reaches(target):
            continue  # the run_as user cannot reach it (under /root): nothing to hide, nowhere bwrap could mount
        if os.path.isdir(target):
            args += ["--tmpfs", target, "--remount-ro", target]
        elif os.path.exists(target):
            args += ["--ro-bind", "/dev/null", target]
    return args


def unix_socket_paths(table: str = "/proc/net/unix") -> list[str]:
    """The paths of the unix sockets bound on this machine (its network namespace), as the kernel lists them."""
    try:
        with open(table, encoding="utf-8", errors="surrogateescape") as f:
            next(f, None)
            rows = [line.rstrip("\n").split(None, 7) for line in f]
    except OSError:
        return []
    return sorted({row[7] for row in rows if len(row) == 8 and row[7].startswith("/")})


def mask_args(spec: SandboxSpec) -> list[str]:
    """/dev/null over each of the machine's unix sockets the policy does not name (when it names some)."""
    if not spec.allow_sockets or ANY_SOCKET in spec.allow_sockets:
        return []
    args: list[str] = []
    for path in unix_socket_paths():
        if os.path.realpath(path) not in spec.allow_sockets and os.path.exists(path) and _bwrap_reaches(spec, path):
            args += ["--ro-bind", "/dev/null", path]
    return args


def _bwrap_reaches(spec: SandboxSpec, path: str) -> bool:
    """Whether bwrap can look up `path` to mount over it. As `run_as`, by that user's mode bits; as this
    process's user likewise, with its groups: even root has no override, in the sandbox's user namespace,
    over a directory whose owner that namespace does not map (a PostgreSQL socket in its 0700 directory,
    /run/user/N/bus), and bwrap failed to start ("Can't mkdir parents"). What bwrap cannot reach, the
    sandboxed command cannot connect to either: it needs no mask."""
    if spec.run_as is not None:
        return spec.run_as.reaches(path)
    uid, gids = os.geteuid(), {os.getegid(), *os.getgroups()}
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.stat(parent)
        except OSError:
            return False
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid in gids else stat.S_IXOTH
        if not st.st_mode & bit:
            return False
        if parent == "/":
            return True
        parent = os.path.dirname(parent)


def live_source(spec: SandboxSpec, index: int) -> str:
    """Where the warden sees live root `index`: inside the layers directory (see warden_argv)."""
    return f"{spec.layers_dir}/.live/{index}"


def tmp_source(spec: SandboxSpec) -> str:
    """Where the warden sees the sessions' private /tmp base: inside the layers directory (see warden_argv)."""
    return f"{spec.layers_dir}/.tmp"


def live_argv(spec: SandboxSpec, argv: list[str], *, cwd: str | None = None, bwrap: str = "bwrap",
              egress_fd: int | None = None, hide: tuple[str, ...] = ()) -> list[str]:
    """A bwrap command running `argv` with the write roots bound writable directly (nothing captured).

    For processes that outlive a call (a stdio MCP server, an application): their writes cannot wait
    for the call to end, so they are not captured, approved or undoable; the rest still holds, and a
    hidden or protected path cannot be created or changed there (`tether.sandbox.confine.guard`).
    `egress_fd`: an inherited unix socket the process's egress proxy port is sent back on (a spec
    without network whose policy lists hosts; see `Sandbox.live_egress`). `hide`: more directories made
    empty and read-only (the sessions' private /tmp directories, `Sandbox.live_hidden`: a live process sees
    the machine's /tmp).
    """
    args = _base(bwrap, spec)
    writable = [root for root in (*spec.write_roots, *spec.live_write_roots) if os.path.isdir(root)
                and (spec.run_as is None or spec.run_as.reaches(root))]  # one run_as cannot reach: not bound
    for root in writable:
        args += ["--bind", root, root]
    # hidden and protected paths stay uncreatable there, existing or not (tether.sandbox.confine.guard)
    args += live_plan(writable, spec.hidden, spec.protected, spec.protected_names, depth=2).bwrap_args(
        lambda path: _bwrap_reaches(spec, path))
    args += hide_args(spec) + mask_args(spec)
    for path in hide:
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
    if cwd:
        args += ["--chdir", cwd]
    shim = confine_argv(spec)
    if egress_fd is not None:
        shim[-1:-1] = ["--egress-fd", str(egress_fd)]
    return [*args, "--", *shim, *argv]


def confine_argv(spec: SandboxSpec) -> list[str]:
    """The shim in front of a live process: the warden's seccomp filter and Landlock IPC scopes, then exec.

    A live process has no warden to confine it, so the same interpreter runs `tether.sandbox.confine.seccomp`
    inside bwrap first (one interpreter start per process: tens of milliseconds, paid once by a
    server or application that then runs for long). Its resource limits are not set: such a process
    is meant to outlive any one command's CPU or memory budget.
    """
    named = ["--any-socket"] if ANY_SOCKET in spec.allow_sockets else ["--allow-unix"] if spec.allow_sockets else []
    return [sys.executable, "-I", "-m", "tether.sandbox.confine.seccomp", *named, "--"]


# `python -I -m tether.sandbox.confine.warden`, but with the `tether.sandbox` package's own `__init__` left
# unrun (found, not executed): it imports `detect` and `spec`, and with them subprocess, shutil, tempfile,
# pathlib and more, none of which the warden uses. The warden is forked for every command: a smaller image
# costs each fork and each `exec` less (docs/security/sandbox-performance.md).
WARDEN_START = (
    "import importlib.util, sys, types\n"
    "found = importlib.util.find_spec('tether.sandbox')\n"
    "package = types.ModuleType('tether.sandbox')\n"
    "package.__path__, package.__spec__ = list(found.submodule_search_locations or ()), found\n"
    "sys.modules['tether.sandbox'] = package\n"
    "from tether.sandbox.confine.warden import main\n"
    "sys.exit(main(sys.argv))\n"
)


def warden_argv(spec: SandboxSpec, python: str, sock_fd: int, *, bwrap: str = "bwrap",
                tmp_base: str | None = None) -> list[str]:
    """The warm sandbox: bwrap running tether's warden, which forks one confined process per command.

    The warden keeps CAP_SYS_ADMIN, CAP_DAC_OVERRIDE (an unprivileged user's overlay over a directory
    it does not own, such as /tmp) and CAP_SETPCAP inside its own user namespace only — where they
    reach no file whose owner is not mapped there, i.e. nobody else's — to mount each command's
    overlay, and drops every capability before the command's program is executed. `tmp_base`: the
    sessions' private /tmp directories (`tether.sandbox.private_tmp`), bound at `tmp_source`.
    """
    args = [*_base(bwrap, spec), "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_DAC_OVERRIDE",
            "--cap-add", "CAP_SETPCAP"]
    # Nothing is mounted below a captured root here: the kernel will not lay an overlay over a tree
    # with mounts in it that the command could not undo (an unprivileged user's bwrap mounts are such).
    # The live roots are bound beside the layers; each command binds them (and hides secrets) itself.
    args += ["--bind", spec.layers_dir, spec.layers_dir]
    for i, root in enumerate(spec.live_write_roots):
        if os.path.isdir(root) and (spec.run_as is None or spec.run_as.reaches(root)):
            args += ["--bind", root, live_source(spec, i)]
    if tmp_base is not None:
        args += ["--bind", tmp_base, tmp_source(spec)]
    args += hide_args(spec, skip_under=spec.write_roots + spec.live_write_roots)
    return [*args, "--", python, "-I", "-c", WARDEN_START, str(sock_fd)]

