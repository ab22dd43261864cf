"""Open paths beneath a root without following any symlink, so the path checked is the path used.

A tool checks `realpath(p)` against its roots and then opens `p`. In between, anyone who can write
inside the roots can swap a component for a symlink (or a `/proc/self/fd/N`-style magic link), and
a plain `open` would land outside. Here every open starts from an fd of the root and no component
may be a symlink: a link swapped in makes the open fail with `EscapeError` instead of being
followed. Linux >= 5.6 does that in one syscall (`openat2` with RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS); elsewhere each component is opened with O_NOFOLLOW
from the previous directory's fd. Callers pass paths already resolved by `realpath`, so a path they
mean never contains a symlink: one found is always a change made after the check.

The helpers after the two openers (`copy_entry`, `move_entry`, `remove_entry`) work on directory
fds and names, so what they touch stays inside the directories the openers returned.

Standard library only: `tether.tools` and `tether.sandbox` both use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import platform
import shutil
import stat
import sys
import uuid
from collections.abc import Callable, Iterator

from tether.errors import SandboxError
from tether.sandbox.layers.filedata import copy_data

__all__ = ["EscapeError", "copy_entry", "move_entry", "open_beneath", "parent_beneath", "remove_entry", "shown"]

_RESOLVE = 0x02 | 0x04 | 0x08  # RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH
_SYS_OPENAT2 = 437  # one number on every architecture but alpha (the syscall tables were unified at 424)
_O_PATH = getattr(os, "O_PATH", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# O_PATH walks through directories that may be searched but not listed; without it, read them.
_WALK = (_O_PATH or os.O_RDONLY) | os.O_DIRECTORY | _NOFOLLOW
_DIR = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
# what open(2) says for O_NOFOLLOW on a symlink: Linux ELOOP, BSDs EMLINK, O_PATH|O_DIRECTORY ENOTDIR
_LINK_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK, errno.ENOTDIR})


class EscapeError(SandboxError, OSError):
    """A path left its root, or one of its components was (or became) a symlink while it was walked."""

    def __init__(self, path: str, why: str, code: int = errno.ELOOP) -> None:
        super().__init__(code, f"{path!r} {why}", path)

    def __str__(self) -> str:
        return str(self.strerror)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(root: str, path: str, flags: int, mode: int = 0o600) -> int:
    """An fd for `path` (absolute inside `root`, or relative to it) opened with `flags`; the caller closes it.

    No component may be a symlink, the last one included (O_NOFOLLOW is always added): one is
    refused with `EscapeError`, as is a path outside `root` or one with `..` in it. Other failures
    are the usual `OSError`s (FileNotFoundError, NotADirectoryError, ...).
    """
    parts = _parts(root, path)
    root_fd = _open_root(root)
    try:
        call = _openat2()
        if call is not None:
            with contextlib.suppress(NotADirectoryError):  # the walk tells a symlink from a file
                return _open2(call, root_fd, parts, flags, mode, path)
        if not parts:
            return os.open(".", flags | _NOFOLLOW, mode, dir_fd=root_fd)
        dir_fd = _walk(root_fd, parts[:-1], path)
        try:
            return _open_at(dir_fd, parts[-1], flags, mode, path)
        finally:
            os.close(dir_fd)
    finally:
        os.close(root_fd)


def parent_beneath(root: str, path: str, *, create: bool = False, mode: int = 0o755) -> tuple[int, str]:
    """(a readable fd of the directory holding `path`, the last component's name); the caller closes the fd.

    Use it for everything that acts on a name rather than through it (unlink, rename, mkdir,
    symlink, lstat: `dir_fd=` calls never follow the last component). `create=True` makes missing
    parent directories with `mode` (mkdirat, one component at a time, never through a link).
    `root` itself has no parent beneath the root: that is an `EscapeError`.
    """
    parts = _parts(root, path)
    if not parts:
        raise EscapeError(path, f"is the root {root!r} itself: it has no parent inside the root", errno.EXDEV)
    root_fd = _open_root(root)
    try:
        call = _openat2()
        if call is not None:
            try:
                return _open2(call, root_fd, parts[:-1], _DIR, 0, path), parts[-1]
            except FileNotFoundError:
                if not create:
                    raise
            except NotADirectoryError:
                pass  # the walk tells a symlink (O_NOFOLLOW with O_DIRECTORY says ENOTDIR) from a file
        walked = _walk(root_fd, parts[:-1], path, create=create, mode=mode)
        try:
            return os.open(".", _DIR, dir_fd=walked), parts[-1]
        finally:
            os.close(walked)
    finally:
        os.close(root_fd)


def shown(path: str | bytes) -> str:
    """`path` as text that any JSON encoder takes: bytes that are not UTF-8 (a name read from disk keeps
    them as lone surrogates, `surrogateescape`) are written `\\xNN`, so a reply never fails to encode."""
    raw = path if isinstance(path, bytes) else os.fsencode(path)
    return raw.decode("utf-8", "backslashreplace")


# ------------------------------------------------------------------------------------------ on dir fds


def copy_entry(src_dir: int, src_name: str, dst_dir: int, dst_name: str, *, merge: bool = False) -> None:
    """Copy a file, symlink (as a link) or directory tree from one directory fd to another, following no link.

    An existing non-directory at the destination is replaced by a rename (never written through);
    an existing directory is an error unless `merge` (then the tree is copied into it, like
    `copytree(dirs_exist_ok=True)`). Mode and mtime are kept.
    """
    st = os.stat(src_name, dir_fd=src_dir, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(src_name, dir_fd=src_dir)
        _replace(dst_dir, dst_name, lambda tmp: os.symlink(target, tmp, dir_fd=dst_dir))
    elif stat.S_ISREG(st.st_mode):
        _replace(dst_dir, dst_name, lambda tmp: _copy_file(src_dir, src_name, dst_dir, tmp, st))
    elif stat.S_ISDIR(st.st_mode):
        _copy_dir(src_dir, src_name, dst_dir, dst_name, st, merge)
    else:
        raise OSError(errno.EINVAL, f"cannot copy {src_name!r}: not a regular file, directory or symlink", src_name)


def move_entry(src_dir: int, src_name: str, dst_dir: int, dst_name: str) -> None:
    """Rename between directory fds; across filesystems, copy (`copy_entry`) and then remove the source."""
    try:
        os.rename(src_name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        copy_entry(src_dir, src_name, dst_dir, dst_name)
        remove_entry(src_dir, src_name)


def remove_entry(dir_fd: int, name: str) -> None:
    """Remove a name in a directory fd: a link or file is unlinked, a directory removed with its contents."""
    if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


# ------------------------------------------------------------------------------------------ internals


def _parts(root: str, path: str) -> list[str]:
    """`path`'s components below `root`; refused when it lies outside or climbs with `..`."""
    if "\x00" in path or "\x00" in root:
        raise EscapeError(path, "contains a NUL byte", errno.EINVAL)
    rel = path
    if os.path.isabs(path):
        prefix = root.rstrip("/") + "/"
        if path.rstrip("/") == root.rstrip("/"):
            return []
        if not path.startswith(prefix):
            raise EscapeError(path, f"lies outside {root!r}", errno.EXDEV)
        rel = path[len(prefix):]
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise EscapeError(path, "contains '..': give the resolved path", errno.EXDEV)
    return parts


def _open_root(root: str) -> int:
    """The root itself must be a directory, not a link to one (roots are resolved when they are checked)."""
    if not os.path.isabs(root):
        raise EscapeError(root, "is not an absolute root", errno.EINVAL)
    try:
        return os.open(root, _WALK)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS and os.path.islink(root):
            raise EscapeError(root, "(a root) is now a symlink; refusing to follow it") from None
        raise


def _open_at(dir_fd: int, name: str, flags: int, mode: int, shown: str) -> int:
    try:
        return os.open(name, flags | _NOFOLLOW, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _LINK_ERRNOS and _is_link(dir_fd, name):
            raise EscapeError(shown, f"has a symlink in it ({name!r}); refusing to follow it") from None
        raise


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _walk(root_fd: int, parts: list[str], shown: str, *, create: bool = False, mode: int = 0o755) -> int:
    """An fd of the directory `parts` names below `root_fd`, one O_NOFOLLOW open per component."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, mode, dir_fd=fd)
            nxt = _open_at(fd, name, _WALK, 0, shown)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


@functools.cache
def _openat2() -> Callable[..., int] | None:
    """The raw `syscall` function when this kernel has a working openat2 (Linux >= 5.6, not filtered)."""
    if sys.platform != "linux" or platform.machine().startswith("alpha"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, 0, _RESOLVE)
    fd = os.open("/", _WALK)
    try:
        probe = call(_SYS_OPENAT2, fd, b".", ctypes.byref(how), ctypes.sizeof(how))
    finally:
        os.close(fd)
    if probe < 0:  # ENOSYS (old kernel) or EPERM (a seccomp filter that does not know it)
        return None
    os.close(probe)
    return call


def _open2(call: Callable[..., int], root_fd: int, parts: list[str], flags: int, mode: int, shown: str) -> int:
    tmpfile = getattr(os, "O_TMPFILE", 0)  # it includes O_DIRECTORY's bit
    creating = flags & os.O_CREAT or (tmpfile and flags & tmpfile == tmpfile)
    how = _OpenHow(flags | _NOFOLLOW, mode if creating else 0, _RESOLVE)  # a mode without O_CREAT is EINVAL
    rel = os.fsencode("/".join(parts) or ".")
    err = errno.EAGAIN
    for _ in range(16):  # EAGAIN: a rename raced the lookup; the kernel asks us to try again
        fd = call(_SYS_OPENAT2, root_fd, rel, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            break
    if err == errno.ELOOP:
        raise EscapeError(shown, "has a symlink in it; refusing to follow it")
    if err == errno.EXDEV:
        raise EscapeError(shown, "leads outside its root", errno.EXDEV)
    raise OSError(err, os.strerror(err), shown)


def _replace(dir_fd: int, name: str, make: Callable[[str], None]) -> None:
    """Make the new entry under a temporary name, then rename it over `name` in one step."""
    tmp = f".tether-{uuid.uuid4().hex}"
    make(tmp)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_entry(dir_fd, tmp)
        raise


def _copy_file(src_dir: int, src_name: str, dst_dir: int, dst_name: str, st: os.stat_result) -> None:
    src = _open_at(src_dir, src_name, os.O_RDONLY, 0, src_name)
    try:
        dst = _open_at(dst_dir, dst_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dst_name)
        try:
            copy_data(src, dst)  # sparse files stay sparse
            os.chmod(dst, stat.S_IMODE(st.st_mode))
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_dir(src_dir: int, src_name: str, dst_dir: int, dst_name: str, st: os.stat_result, merge: bool) -> None:
    try:
        os.mkdir(dst_name, 0o700, dir_fd=dst_dir)
    except FileExistsError:
        if not merge:
            raise
    with _dir_fd(src_dir, src_name) as src, _dir_fd(dst_dir, dst_name) as dst:
        for child in sorted(os.listdir(src)):
            copy_entry(src, child, dst, child, merge=merge)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


@contextlib.contextmanager
def _dir_fd(dir_fd: int, name: str) -> Iterator[int]:
    fd = _open_at(dir_fd, name, _DIR, 0, name)
    try:
        yield fd
    finally:
        os.close(fd)
