"""File tools' work on entries through directory fds: reading, listing, creating, opening, moving.

Each helper takes an fd (or a path already judged by the jail) and never follows a link it was not
told to; the checks a change needs live in `guards`.
"""

from __future__ import annotations

import base64
import codecs
import os
import stat
import time
from pathlib import Path
from typing import Any

from tether.sandbox.layers.fs import move_entry
from tether.tools.context import ToolContext
from tether.tools.errors import ToolError
from tether.tools.files.guards import _journal, _require_one_link
from tether.tools.policy.hidden import HiddenSet, check_hidden_inode
from tether.tools.policy.jail import open_at, open_in, parent_in, real

_KIND = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not hang a tool; it is refused after fstat


def _kind(mode: int) -> str:
    return _KIND.get(stat.S_IFMT(mode), "other")


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _pread(fd: int, size: int, offset: int) -> bytes:
    """Up to `size` bytes from `offset`; short reads are only allowed at end of file."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _check_encoding(encoding: str) -> None:
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ToolError(f"unknown encoding {encoding!r}") from None


def _decode(data: bytes, encoding: str, truncated: bool) -> tuple[str, int, bool]:
    """Text if it decodes (a character cut by truncation is left for the next read), else base64."""
    if b"\x00" not in data:
        try:
            return data.decode(encoding), len(data), False
        except UnicodeDecodeError as exc:
            if truncated and exc.start >= len(data) - 3 and exc.start > 0:
                try:
                    return data[: exc.start].decode(encoding), exc.start, False
                except UnicodeDecodeError:
                    pass
    return base64.b64encode(data).decode("ascii"), len(data), True


def _conceals(hidden: HiddenSet, dir_fd: int, directory: Path, name: str) -> bool:
    """A hidden path is left out of its parent's listing, and so is a symlink that leads into one."""
    if hidden.by(directory / name) is not None:
        return True
    try:
        if not stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
    except OSError:
        return False
    return hidden.by(real(directory / name)) is not None


def _list_entry(dir_fd: int, name: str) -> dict[str, Any] | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        entry: dict[str, Any] = {"name": name, "type": _kind(st.st_mode), "size": st.st_size,
                                 "mtime": _iso(st.st_mtime)}
        if entry["type"] == "symlink":
            entry["target"] = os.readlink(name, dir_fd=dir_fd)
    except OSError:  # removed (or replaced) while we listed
        return None
    return entry


def _readlink(ctx: ToolContext, entry: Path) -> str:
    dir_fd, name = parent_in(ctx.policy, entry, write=False)
    try:
        return os.readlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _create(dir_fd: int, name: str, path: Path) -> int:
    try:
        return open_at(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, path, 0o666)
    except FileExistsError:
        raise ToolError(f"already exists: {path} (it appeared while this call ran; look at it and retry)") from None


def _open_existing(ctx: ToolContext, dir_fd: int, name: str, path: Path, *, append: bool) -> int:
    """The file to change, checked again on its fd: what is written is what was judged (no FIFO, no
    new hard link since the check)."""
    fd = open_at(dir_fd, name, os.O_WRONLY | _NONBLOCK | (os.O_APPEND if append else 0), path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"not a regular file: {path} ({_kind(st.st_mode)}); it changed while this call ran")
        _require_one_link(ctx, st, path)
        check_hidden_inode(ctx.policy, st, path, ctx.secrets)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _journal_open(ctx: ToolContext, fd: int, path: Path, *, truncate: bool) -> bool:
    """Journal the original, then truncate: the file is opened (and checked) before anything is saved."""
    try:
        journaled = _journal(ctx, "write", path)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return journaled


def _has_entries(ctx: ToolContext, directory: Path) -> bool:
    fd = open_in(ctx.policy, directory, os.O_RDONLY | os.O_DIRECTORY, write=True)
    try:
        return bool(os.listdir(fd))
    finally:
        os.close(fd)


def _move(ctx: ToolContext, src: Path, dst: Path) -> None:
    src_fd, src_name = parent_in(ctx.policy, src, write=True)
    try:
        dst_fd, dst_name = parent_in(ctx.policy, dst, write=True)
        try:
            move_entry(src_fd, src_name, dst_fd, dst_name)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
