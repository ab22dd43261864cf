"""Which sandboxed command holds the client end of a proxied connection, read from /proc on the device.

The egress proxy accepts on the sandbox's loopback; the connection's peer (address, port) names a
socket in the warden's network namespace. Its inode comes from `/proc/<warden>/net/tcp` (the kernel
walks its whole TCP table for that file, so callers run this off the event loop), then
the fds of each command — a child of the warden, pid 1 of its own pid namespace — and of everything
it started are searched for that socket. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import socket

MAX_PROCESSES = 4096  # searched per command at most


def command_holding(warden: int, peer: tuple[str, int]) -> int | None:
    """The warden's own pid (inside its pid namespace) of the command whose process tree holds the TCP
    socket bound to `peer`, or None. `warden` is the warden's pid on this machine."""
    inode = _tcp_inode(warden, peer)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for command in children(warden):
        if any(_holds(proc, target) for proc in _descendants(command)):
            return _nspid(command, -2)
    return None


def children(pid: int) -> list[int]:
    """The pids of `pid`'s children (none when it is gone); the sandbox's runner uses it too."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < MAX_PROCESSES:
        current = todo.pop()
        out.append(current)
        todo += children(current)
    return out


def _holds(pid: int, target: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
    return False


def _nspid(pid: int, index: int) -> int | None:
    """One of the pids `pid` has in its pid namespaces (NSpid: outermost first), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"NSpid:"):
                    ids = line.split()[1:]
                    return int(ids[index]) if len(ids) >= abs(index) else None
    except (OSError, ValueError):
        return None
    return None


def _tcp_inode(pid: int, peer: tuple[str, int]) -> int | None:
    """The inode of the IPv4 TCP socket bound to `peer` in the network namespace of process `pid`."""
    try:
        packed = socket.inet_aton(peer[0])
    except OSError:
        return None
    local = f"{int.from_bytes(packed, 'little'):08X}:{peer[1]:04X}"
    try:
        with open(f"/proc/{pid}/net/tcp") as table:
            next(table, None)
            for line in table:
                fields = line.split()
                if len(fields) > 9 and fields[1] == local:
                    return int(fields[9])
    except (OSError, ValueError):
        return None
    return None
