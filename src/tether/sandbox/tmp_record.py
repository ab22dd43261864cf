"""Where a device records its sessions' private /tmp base (`tether.sandbox.private_tmp`) for its next run: the file
`private-tmp-base` in its own state directory, so each device (each state directory) has its own record and
base, and one user's devices never find or overwrite each other's.

Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat

logger = logging.getLogger(__name__)

RECORD = "private-tmp-base"  # in the device's state directory: the base's path, for the next run
_RECORD_MAX = 4096  # a record is one path: anything larger is not one


class TmpRecord:
    """The file `private-tmp-base` in a state directory: one line, the base's path. Every access goes through
    the directory's descriptor, checked to be this process's user's and writable by nobody else, and the file
    is opened with `O_NOFOLLOW` and checked the same way, so neither a link nor a file another user could
    write is ever taken for it. A process holds its state directory alone (`device.lock`), so nothing else
    writes it meanwhile. Blocking file I/O; errors are logged and taken as "no record"."""

    def __init__(self, state_dir: str) -> None:
        """`state_dir`: the device's state directory (made, mode 0700, when the first record is written)."""
        self.dir = state_dir
        self._said: set[str] = set()  # the warnings logged already: each once (the record is read at every look)

    def __str__(self) -> str:
        return os.path.join(self.dir, RECORD)

    def warn(self, message: str) -> None:
        """Log `message` as a warning, once for this record."""
        if message not in self._said:
            self._said.add(message)
            logger.warning("%s", message)

    def _open_dir(self, make: bool) -> int | None:
        if make:
            with contextlib.suppress(OSError):
                os.makedirs(self.dir, mode=0o700, exist_ok=True)
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's path, as given
        except OSError:
            return None
        if not _private(os.fstat(fd)):
            os.close(fd)
            self.warn(f"{self.dir} is not this user's alone: the private /tmp base is not recorded there")
            return None
        return fd

    def read(self) -> str | None:
        """The recorded path, or None (no record, or one that is a link, not a plain file, not ours, or odd)."""
        dir_fd = self._open_dir(make=False)
        if dir_fd is None:
            return None
        try:
            fd = os.open(RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a link in its place
            self.warn(f"{self} cannot be read ({exc.strerror}): a new private /tmp base is made")
            return None
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _private(st) or st.st_size > _RECORD_MAX:
                self.warn(f"{self} is not a record this device wrote: a new private /tmp base is made")
                return None
            raw = os.read(fd, _RECORD_MAX + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            return raw.decode("utf-8").strip() or None
        except UnicodeDecodeError:
            return None

    def write(self, base: str) -> None:
        """Record `base` (a new file renamed over the old one: a crash leaves one or the other)."""
        dir_fd = self._open_dir(make=True)
        if dir_fd is None:
            return
        temp = f".{RECORD}.{os.getpid()}"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=dir_fd)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            try:
                os.write(fd, (base + "\n").encode("utf-8", "surrogateescape"))
            finally:
                os.close(fd)
            os.replace(temp, RECORD, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            logger.warning("%s cannot be written (%s): a restarted device makes a new private /tmp base",
                           self, exc.strerror)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def drop(self, base: str) -> None:
        """Remove the record if it names `base` (the base is gone)."""
        if self.read() != base:
            return
        dir_fd = self._open_dir(make=False)
        if dir_fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.unlink(RECORD, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)


def _private(st: os.stat_result) -> bool:
    """Whether a file or directory is this process's user's and nobody else may write it."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022
