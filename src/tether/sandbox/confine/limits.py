"""Resource limits of one sandboxed command: set by the warden before exec, named by the device after.

Where no cgroup v2 subtree is delegated to the device (the common case: a user's session, a container,
a CI runner), the kernel's per-process limits and the command's own namespaces are what holds:

- `memory_mb`: RLIMIT_DATA, the private writable memory (heap, anonymous mappings) of each process;
  a reservation that is never made writable (V8's, Go's) does not count, so runtimes still start.
- `processes`: the `pid_max` of the command's own pid namespace (Linux 6.14+): processes and threads
  of the whole command together, whatever the user — root included, whom RLIMIT_NPROC exempts. The
  kernel's floor is 300. On older kernels RLIMIT_NPROC is set instead (per user, not per command).
- `cpu_seconds`: RLIMIT_CPU of each process: SIGXCPU at the limit, SIGKILL a second later (the
  command's first process, pid 1 of its namespace, is deaf to SIGXCPU: the SIGKILL is what stops it).
- `file_size_mb`: RLIMIT_FSIZE: no file written larger (SIGXFSZ, or EFBIG where that is ignored).
- `open_files`: RLIMIT_NOFILE of each process.
- `shm_mb`: the size of the command's private `/dev/shm` (a tmpfs made for the command, gone with it).

Standard library only: the warden imports it.
"""

from __future__ import annotations

import os
import re
import resource
import signal
from dataclasses import asdict, dataclass
from typing import Any

MIB = 1 << 20
PID_MAX_FLOOR = 301  # the kernel refuses a smaller pid_max (RESERVED_PIDS + 1)
CPU_KILL_GRACE_S = 1  # from SIGXCPU (soft) to SIGKILL (hard)


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-command resource limits; 0 means not limited by tether (the device's own limits still apply)."""

    memory_mb: int = 0
    processes: int = 0
    cpu_seconds: int = 0
    file_size_mb: int = 0
    open_files: int = 0
    shm_mb: int = 0

    def to_request(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_request(cls, data: dict[str, Any] | None) -> Limits:
        return cls(**{k: int(v) for k, v in (data or {}).items() if k in cls.__dataclass_fields__})


def _lower(which: int, soft: int, hard: int | None = None) -> None:
    """Lower a limit: neither value is ever raised above what the device itself was given."""
    cur_soft, cur_hard = resource.getrlimit(which)
    hard = soft if hard is None else hard
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
    if cur_soft != resource.RLIM_INFINITY:
        soft = min(soft, cur_soft)
    resource.setrlimit(which, (min(soft, hard), hard))


def set_pid_max(processes: int) -> bool:
    """Cap the current pid namespace (its /proc mounted at /proc) at about `processes` tasks; False when
    this kernel keeps one pid_max for the whole machine (before 6.14) and so cannot."""
    try:  # os.open, not open(): no text layer to build in a freshly forked process
        fd = os.open("/proc/sys/kernel/pid_max", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.write(fd, str(max(processes + 1, PID_MAX_FLOOR)).encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def apply_in_command(limits: dict[str, int]) -> None:
    """In the command's pid 1, before its capabilities are dropped and its program executed.

    Takes the request's plain mapping (`Limits.to_request()`), not a `Limits`: a process just forked
    from the warden pays a page copy for every object it touches, so it builds as few as it can.
    """
    processes, memory, cpu, size, files = (int(limits.get(k) or 0) for k in (
        "processes", "memory_mb", "cpu_seconds", "file_size_mb", "open_files"))
    if processes and not set_pid_max(processes):
        _lower(resource.RLIMIT_NPROC, processes)
    if memory:
        _lower(resource.RLIMIT_DATA, memory * MIB)
    if cpu:
        _lower(resource.RLIMIT_CPU, cpu, cpu + CPU_KILL_GRACE_S)
    if size:
        _lower(resource.RLIMIT_FSIZE, size * MIB)
    if files:
        _lower(resource.RLIMIT_NOFILE, files)


# What programs print when a limit refuses them (the kernel tells only through an errno they report).
_SAYS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("memory_mb", re.compile(r"MemoryError|Cannot allocate memory|out of memory|bad_alloc|memory exhausted|"
                             r"Allocation failed|ENOMEM", re.IGNORECASE)),
    # EAGAIN alone is also a non-blocking read's: only with a process or thread being made, or as
    # Python's BlockingIOError (what an uncaught failed fork raises; an uncaught non-blocking read rarely is)
    ("processes", re.compile(r"fork: retry|can't fork|cannot fork|BlockingIOError: \[Errno 11\]|"
                             r"(fork|thread|clone|spawn)[^\n]*(\n[^\n]*){0,2}?(Resource temporarily unavailable|EAGAIN|"
                             r"BlockingIOError)|(Resource temporarily unavailable|EAGAIN)[^\n]*(fork|thread|clone)",
                             re.IGNORECASE)),
    ("open_files", re.compile(r"Too many open files|EMFILE", re.IGNORECASE)),
    ("file_size_mb", re.compile(r"File too large|File size limit exceeded|EFBIG", re.IGNORECASE)),
    ("cpu_seconds", re.compile(r"CPU time limit exceeded", re.IGNORECASE)),
)


def exceeded(limits: Limits, exit_code: int, stderr: str, cpu_s: float | None = None) -> str | None:
    """The limit a failed command ran into, or None: by the signal that ended it where the kernel sends
    one (SIGXCPU, SIGXFSZ, or SIGKILL past the CPU limit), else by the error the program printed."""
    if exit_code == 0:
        return None
    if exit_code in (-signal.SIGXCPU, 128 + signal.SIGXCPU) and limits.cpu_seconds:
        return "cpu_seconds"
    if exit_code == -signal.SIGKILL and limits.cpu_seconds and cpu_s is not None and cpu_s >= limits.cpu_seconds:
        return "cpu_seconds"
    if exit_code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) and limits.file_size_mb:
        return "file_size_mb"
    tail = stderr[-4096:]
    for name, says in _SAYS:
        if getattr(limits, name) and says.search(tail):
            return name
    return None


def describe(limits: Limits, name: str) -> str:
    """`memory_mb (512)`: the limit as the policy spells it, with its value."""
    return f"limits.{name} ({getattr(limits, name)})"


def shm_options(limits: Limits) -> str:
    """The mount options of a command's private /dev/shm."""
    size = f"size={limits.shm_mb}m" if limits.shm_mb else "size=50%"
    return f"{size},mode=1777"


__all__ = ["Limits", "apply_in_command", "describe", "exceeded", "set_pid_max", "shm_options"]
