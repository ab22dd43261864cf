"""Why a state directory cannot be written: a full, read-only or unopenable disk, said in one line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

MIN_FREE_BYTES = 1 << 20  # less free space than this in the state directory counts as a full disk
_SQLITE_READONLY, _SQLITE_IOERR, _SQLITE_FULL, _SQLITE_CANTOPEN = 8, 10, 13, 14


def disk_problem(exc: BaseException, where: str | Path) -> str | None:
    """One line saying why `exc` means the state at `where` cannot be written, or None when it is not
    that kind of error (a bug, a constraint)."""
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    number = exc.errno if isinstance(exc, OSError) else None
    text = str(exc).replace("\n", " ")
    if primary == _SQLITE_FULL or number in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in text:
        return f"disk full: cannot write {where} ({text})"
    if primary == _SQLITE_READONLY or number == errno.EROFS or "readonly" in text or "read-only" in text:
        return f"read-only disk: cannot write {where} ({text})"
    if primary == _SQLITE_IOERR or number == errno.EIO:
        # SQLite reports a full disk met while sizing its shared-memory file as an I/O error
        full = free_space_problem(Path(where).parent)
        return f"{full} ({text})" if full else f"disk I/O error: cannot write {where} ({text})"
    if primary == _SQLITE_CANTOPEN or number in (errno.EACCES, errno.EPERM):
        return f"cannot open {where} for writing ({text})"
    return None


def free_space_problem(directory: str | Path, minimum: int = MIN_FREE_BYTES) -> str | None:
    """A full-disk message when `directory` has less than `minimum` bytes free (what this process may
    use: root may use the blocks reserved for it), else None."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return None  # a directory that cannot be examined is reported by the write that fails
    blocks = stats.f_bfree if os.geteuid() == 0 else stats.f_bavail
    free = blocks * stats.f_frsize
    if free >= minimum:
        return None
    return f"disk full: {directory} has {free // 1024} KiB free (the server needs at least {minimum // 1024} KiB)"
