"""Landlock: the kernel's own write barrier, laid under the mount namespace as a second wall.

The namespaces already make everything outside the write roots read-only; Landlock says the same
thing again in a different part of the kernel (an LSM that checks every open, rename and unlink
against rules bound to this process and its children), so one bug in either does not open the
machine. Rules only ever restrict, cannot be lifted by the confined program, and need no privilege.

From ABI 6 the same ruleset also scopes IPC: a confined process cannot connect to an abstract unix
socket, nor send a signal to a process, outside its own Landlock domain (`SCOPES`).
"""

from __future__ import annotations

import ctypes
import functools
import os

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # same numbers on x86_64 and arm64
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = (1 << n for n in range(6, 13))
REFER, TRUNCATE = 1 << 13, 1 << 14
_WRITES = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
           | MAKE_BLOCK | MAKE_SYM)


SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
SCOPES_ABI = 6  # the first ABI with scopes


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """The Landlock ABI this kernel offers; 0 when it has none (or it is switched off)."""
    if os.uname().sysname != "Linux" or os.uname().machine not in ("x86_64", "aarch64"):
        return 0
    version = _libc().syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(int(version), 0)


def write_rights(abi: int) -> int:
    return _WRITES | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0)


def scopes(abi: int, *, abstract: bool = True, signals: bool = True) -> int:
    """The IPC scopes this ABI offers (0 before ABI 6): connecting to abstract unix sockets and sending
    signals outside the domain, each unless switched off here."""
    if abi < SCOPES_ABI:
        return 0
    return (SCOPE_ABSTRACT_UNIX_SOCKET if abstract else 0) | (SCOPE_SIGNAL if signals else 0)


def _attr(fs_rights: int, scoped: int) -> tuple[_RulesetAttr, int]:
    """The ruleset attribute, and the size to pass: the old one-field size when nothing is scoped
    (an ABI < 4 kernel refuses a bigger struct with non-zero fields it does not know)."""
    attr = _RulesetAttr(fs_rights, 0, scoped)
    return attr, (ctypes.sizeof(attr) if scoped else ctypes.sizeof(ctypes.c_uint64))


def restrict_scopes(abi: int, *, abstract: bool = True, signals: bool = True) -> None:
    """Only the IPC scopes (no file rule): for a process whose writes the mounts already decide."""
    scoped = scopes(abi, abstract=abstract, signals=signals)
    if not scoped:
        return
    libc = _libc()
    attr, size = _attr(0, scoped)
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        if libc.syscall(SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)


def restrict_writes(writable: list[str], abi: int, *, scoped: int = 0) -> None:
    """Allow writes only beneath `writable` for this process and all it executes. Needs no_new_privs.

    `scoped` (see `scopes()`) adds IPC scopes to the same ruleset: one Landlock layer, not two.
    """
    ruleset = write_ruleset(writable, abi, scoped=scoped)
    try:
        restrict_self(ruleset)
    finally:
        os.close(ruleset)


def write_ruleset(writable: list[str], abi: int, *, scoped: int = 0) -> int:
    """The ruleset `restrict_writes` applies, made but not applied: its fd (close-on-exec), for
    `restrict_self` later. Its rules hold the directories `writable` names now (a mount made over one of
    them afterwards is not what the rule names)."""
    libc = _libc()
    rights = write_rights(abi)
    attr, size = _attr(rights, scoped)
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path in writable:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                rule = _PathBeneath(rights, fd)
                if libc.syscall(SYS_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
            finally:
                os.close(fd)
    except BaseException:
        os.close(ruleset)
        raise
    return int(ruleset)


def restrict_self(ruleset: int) -> None:
    """Apply a ruleset (`write_ruleset`) to this process and all it executes. Needs no_new_privs."""
    if _libc().syscall(SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
