"""A seccomp filter that keeps a sandboxed process from opening sockets it has no business with.

Installed by the warden as the last step before a command's program is executed (and by
`python -m tether.sandbox.confine.seccomp` in front of a live process), it is inherited by everything the
program starts and cannot be removed. What it refuses:

- `socket(AF_UNIX, ...)` with EPERM, unless the policy names sockets (`allow_sockets`): no unix socket
  at all means no tmux server, session bus, ssh-agent, Docker or X11 socket outside the sandbox, by
  path or abstract name. `socketpair()` is a different call and stays allowed (pipes between a
  program's own processes: Python's asyncio, libuv, multiprocessing).
- every address family but AF_INET, AF_INET6, AF_UNIX (as above) and AF_NETLINK's NETLINK_ROUTE,
  with EAFNOSUPPORT (as if the kernel lacked them): AF_VSOCK reaches a VM's host whatever the network
  namespace says, `sock_diag` netlink lists the machine's sockets, the rest is kernel attack surface.
- `io_uring_setup` with ENOSYS (programs fall back to plain calls): io_uring's own socket and connect
  operations would not pass through this filter.
- on x86_64, the x32 system-call range, and the i386 entry's socket calls (the filter checks the
  architecture every call, so a 32-bit call cannot slip past the 64-bit numbers).

Standard library only (the warden runs it): the classic-BPF program is assembled here with `struct`.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
import struct
import sys

from tether.sandbox.confine.landlock import abi_version, restrict_scopes

AUDIT_ARCH_X86_64, AUDIT_ARCH_I386, AUDIT_ARCH_AARCH64 = 0xC000003E, 0x40000003, 0xC00000B7
X32_SYSCALL_BIT = 0x40000000
AF_UNIX, AF_INET, AF_NETLINK, AF_INET6 = 1, 2, 16, 10
NETLINK_ROUTE = 0
SYS_SOCKET_CALL = 1  # socketcall(2)'s number for socket()

# (audit arch, socket, io_uring_setup) per machine; i386 is x86_64's compatibility entry
_NATIVE = {"x86_64": (AUDIT_ARCH_X86_64, 41, 425), "aarch64": (AUDIT_ARCH_AARCH64, 198, 425)}
_CONNECT = {"x86_64": 42, "aarch64": 203}
# connect(2) address lengths a display's program keeps: sockaddr_nl, sockaddr_in, sockaddr_in6, and from a
# whole sockaddr_un (what libxcb gives a pathname) up; shorter ones are abstract unix addresses (see `program`)
_KEPT_ADDRLEN, _FULL_SUN = (12, 16, 28), 110
_I386_SOCKET, _I386_SOCKETCALL, _I386_IO_URING_SETUP = 359, 102, 425

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# offsets into struct seccomp_data: nr, arch, then args[6] as u64 from 16 (the low half first: little-endian)
_NR, _ARCH, _ARG0, _ARG2 = 0, 4, 16, 32
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


def _errno(code: int) -> int:
    return _RET_ERRNO | code


class _Program:
    """A tiny assembler: jumps name labels, resolved to the forward offsets classic BPF needs."""

    def __init__(self) -> None:
        self.code: list[tuple[int, str | int, str | int, int]] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.code.append((_LD_W_ABS, 0, 0, offset))

    def jump(self, op: int, value: int, when_true: str, when_false: str | int = 0) -> None:
        self.code.append((op, when_true, when_false, value))

    def ret(self, value: int) -> None:
        self.code.append((_RET_K, 0, 0, value))

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (op, jt, jf, k) in enumerate(self.code):
            out += struct.pack("=HBBI", op, self._offset(pc, jt), self._offset(pc, jf), k)
        return bytes(out)

    def _offset(self, pc: int, target: str | int) -> int:
        if isinstance(target, int):
            return target
        distance = self.labels[target] - pc - 1
        if not 0 <= distance <= 255:
            raise ValueError(f"seccomp: jump to {target} out of range")
        return distance


@functools.cache
def program(machine: str, allow_unix: bool, display: bool = False) -> bytes:
    """The filter for `machine` (os.uname().machine) as packed `struct sock_filter`s.

    `allow_unix`: whether `socket(AF_UNIX)` passes (the policy names sockets; the mount masks and
    Landlock's abstract-socket scope then decide what it reaches).
    `display`: a launched GUI program, allowed its X display's socket. libxcb tries the display's
    abstract address first and falls back to the pathname only on ENOENT or ECONNREFUSED, but
    Landlock's scope refuses an abstract address that exists outside with EPERM: so here a connect(2)
    whose address is shorter than a whole sockaddr_un and is no netlink, IPv4 or IPv6 one (an abstract
    address: `@/tmp/.X11-unix/X0` is 21 bytes, the pathname 110) fails with ECONNREFUSED, before
    Landlock would refuse it anyway.
    """
    if machine not in _NATIVE:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {machine}")
    arch, nr_socket, nr_io_uring = _NATIVE[machine]
    p = _Program()
    p.load(_ARCH)
    p.jump(_JEQ_K, arch, "native")
    if machine == "x86_64":
        p.jump(_JEQ_K, AUDIT_ARCH_I386, "i386")
    p.ret(_errno(errno.EPERM))  # an architecture this filter does not know: refuse everything
    p.label("native")
    p.load(_NR)
    if machine == "x86_64":
        p.jump(_JGE_K, X32_SYSCALL_BIT, "eperm")
    p.jump(_JEQ_K, nr_socket, "socket")
    p.jump(_JEQ_K, nr_io_uring, "enosys")
    if display:
        p.jump(_JEQ_K, _CONNECT[machine], "connect")
    p.ret(RET_ALLOW)
    if machine == "x86_64":  # (classic BPF jumps only forward: the shared blocks come after both entries)
        p.label("i386")
        p.load(_NR)
        p.jump(_JEQ_K, _I386_SOCKET, "socket")
        p.jump(_JEQ_K, _I386_IO_URING_SETUP, "enosys")
        p.jump(_JEQ_K, _I386_SOCKETCALL, "socketcall")
        p.ret(RET_ALLOW)
        p.label("socketcall")  # its arguments lie in memory a filter cannot read: no socket() this way
        p.load(_ARG0)
        p.jump(_JEQ_K, SYS_SOCKET_CALL, "eperm")
        p.ret(RET_ALLOW)
    p.label("socket")
    p.load(_ARG0)
    p.jump(_JEQ_K, AF_INET, "allow")
    p.jump(_JEQ_K, AF_INET6, "allow")
    p.jump(_JEQ_K, AF_UNIX, "allow" if allow_unix else "eperm")
    p.jump(_JEQ_K, AF_NETLINK, "netlink")
    p.ret(_errno(errno.EAFNOSUPPORT))
    p.label("netlink")
    p.load(_ARG2)
    p.jump(_JEQ_K, NETLINK_ROUTE, "allow")
    p.ret(_errno(errno.EAFNOSUPPORT))
    if display:
        p.label("connect")
        p.load(_ARG2)  # the address length (a socklen_t: the low half is all of it)
        p.jump(_JGE_K, _FULL_SUN, "allow")
        for kept in _KEPT_ADDRLEN:
            p.jump(_JEQ_K, kept, "allow")
        p.ret(_errno(errno.ECONNREFUSED))
    p.label("allow")
    p.ret(RET_ALLOW)
    p.label("eperm")
    p.ret(_errno(errno.EPERM))
    p.label("enosys")
    p.ret(_errno(errno.ENOSYS))
    return p.assemble()


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Filter:
    """A filter ready to install: built once (in the warden, before it forks), installed in each command.

    Everything is made here so that the forked command only makes one call: a Python process just
    forked pays a page copy for every object it touches, so the program is built before the fork.
    """

    def __init__(self, allow_unix: bool = False, display: bool = False) -> None:
        code = program(os.uname().machine, allow_unix, display)
        self._buf = ctypes.create_string_buffer(code, len(code))
        self._prog = _SockFprog(len(code) // 8, ctypes.cast(self._buf, ctypes.c_void_p))
        self._ref = ctypes.byref(self._prog)
        self._prctl = _libc().prctl
        self._mode = ctypes.c_ulong(SECCOMP_MODE_FILTER)

    def install(self) -> None:
        """On this thread and everything it executes. Needs no_new_privs (or CAP_SYS_ADMIN)."""
        if self._prctl(PR_SET_SECCOMP, self._mode, self._ref, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"seccomp filter: {os.strerror(err)}")


@functools.cache
def prepared(allow_unix: bool, display: bool = False) -> Filter:
    """The process's one `Filter` of each kind: call it before forking, so the fork finds it made."""
    return Filter(allow_unix, display)


def install(allow_unix: bool = False) -> None:
    """Build and install the filter (see `Filter` for the warden's prepared one)."""
    Filter(allow_unix).install()


PROXY_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
NO_PROXY_ENV = ("NO_PROXY", "no_proxy")


def proxy_variables(port: int) -> dict[str, str]:
    """The environment that takes a program's HTTP and SOCKS clients through the egress proxy on `port`."""
    http, socks = f"http://127.0.0.1:{port}", f"socks5h://127.0.0.1:{port}"
    return {name: socks if "all" in name.lower() else http for name in PROXY_ENV}


def hand_over_listener(channel_fd: int) -> int:
    """Open the egress proxy's port on this network namespace's loopback and send the listening socket to
    the device over `channel_fd` (a unix socket it passed down; closed here), as the warden's `listen`
    op does; the port, for the program's environment. OSError when it cannot."""
    channel = socket.socket(fileno=channel_fd)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(socket.SOMAXCONN)
        port = int(listener.getsockname()[1])
        socket.send_fds(channel, [str(port).encode()], [listener.fileno()])
        return port
    finally:
        listener.close()
        channel.close()


def main(argv: list[str]) -> int:
    """`python -I -m tether.sandbox.confine.seccomp [--allow-unix | --any-socket] [--egress-fd N] -- PROGRAM ARG...`.

    For processes bwrap starts directly (live ones, see `bwrap.confine_argv`): the same filter and
    Landlock scopes as a warden's command, then the program (found on PATH) in place of this interpreter.
    `--allow-unix`: unix sockets may be made (the policy names some; abstract ones stay scoped away);
    `--any-socket`: any, abstract ones too. `--egress-fd N`: the sandbox has no direct network and the
    device's egress proxy serves it: a listening port on its loopback goes to the device over fd N
    (`hand_over_listener`) and the program's environment points its proxy variables there.
    """
    args = argv[1:]
    allow_unix = any_socket = False
    egress_fd: int | None = None
    while args and args[0] != "--":
        if args[0] == "--allow-unix":
            allow_unix, args = True, args[1:]
        elif args[0] == "--any-socket":
            any_socket, args = True, args[1:]
        elif args[0] == "--egress-fd" and len(args) > 1 and args[1].isdigit():
            egress_fd, args = int(args[1]), args[2:]
        else:
            sys.stderr.write(f"tether sandbox: unknown option {args[0]}\n")
            return 2
    program_argv = args[1:]
    if not program_argv:
        sys.stderr.write("tether sandbox: no program to run\n")
        return 2
    try:
        if egress_fd is not None:
            try:
                port = hand_over_listener(egress_fd)
            except OSError as exc:
                sys.stderr.write(f"tether sandbox: no egress proxy for {program_argv[0]}: {exc}\n")
                return 126
            for name in NO_PROXY_ENV:
                os.environ.pop(name, None)
            os.environ.update(proxy_variables(port))
        libc = _libc()
        libc.prctl(38, ctypes.c_ulong(1), 0, 0, 0)  # PR_SET_NO_NEW_PRIVS (bwrap has set it already)
        restrict_scopes(abi_version(), abstract=not any_socket)
        install(allow_unix or any_socket)
        os.execvp(program_argv[0], program_argv)  # noqa: S606 (an argv list, never a shell)
    except OSError as exc:
        sys.stderr.write(f"tether sandbox: could not start {program_argv[0]}: {exc}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
