"""The sending half of a file transfer between devices: describe what is sent, then hand it out in chunks.

A server-side transfer service (`tether.server.aip.transfer`) drives these tools on the sending device and
the receiving half (`transfer_receive`) on the other. Reading obeys the sender's rules as `read_file` does:
the path is jail-checked (read roots, hidden paths, the device's state directory), so a hidden path such
as `~/.ssh` is never described nor read; a directory holding a hidden path is refused whole (nothing of
it is sent) rather than sent with holes nobody asked for. A directory keeps its relative layout; a
symlink that leads outside the tree, a FIFO, socket or device file is refused, and so is the whole
transfer with it, naming the entry.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from tether.tools.context import ToolContext
from tether.tools.errors import PolicyDenied, ToolError
from tether.tools.files.tool import _resolve
from tether.tools.policy.hidden import HiddenSet, check_hidden_inode
from tether.tools.policy.jail import open_in, real, within
from tether.tools.runtime import tool

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_HASH_CHUNK = 1 << 20
MAX_FILES = 100_000  # entries one manifest may list, at most


def sha256_fd(fd: int, size: int) -> str:
    """The sha256 (hex) of the first `size` bytes of an open file; OSError when it is shorter now."""
    digest = hashlib.sha256()
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(_HASH_CHUNK, size - offset), offset)
        if not chunk:
            raise OSError(f"the file shrank while it was read ({offset} of {size} bytes)")
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _file_entry(rel: str, path: Path, st: os.stat_result) -> dict[str, Any]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | _NONBLOCK)
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or now.st_ino != st.st_ino:
            raise ToolError(f"{str(path)!r} changed while it was described; send it again")
        return {"path": rel, "type": "file", "size": now.st_size, "mode": stat.S_IMODE(now.st_mode) & 0o777,
                "sha256": sha256_fd(fd, now.st_size)}
    finally:
        os.close(fd)


def _walk(ctx: ToolContext, root: Path, max_bytes: int) -> list[dict[str, Any]]:
    """Every entry below `root` (sorted, directories before what they hold), or ToolError naming the first
    entry that cannot be sent: hidden, a special file, a symlink leading out of the tree, or past a cap."""
    hidden = HiddenSet.of(ctx.policy, ctx.secrets)
    entries: list[dict[str, Any]] = []
    total = 0
    stack = [root]
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as listing:
            names = sorted(e.name for e in listing)
        subdirs: list[Path] = []
        for name in names:
            path = directory / name
            rel = path.relative_to(root).as_posix()
            by = hidden.by(path)
            if by is not None:
                raise PolicyDenied("hide_paths", f"{str(root)!r} holds the hidden path {str(path)!r} ({by}): "
                                                 "nothing of it is sent")
            st = os.lstat(path)
            if len(entries) >= MAX_FILES:
                raise ToolError(f"{str(root)!r} holds more than {MAX_FILES} entries: send a smaller tree")
            if stat.S_ISDIR(st.st_mode):
                entries.append({"path": rel, "type": "dir", "mode": stat.S_IMODE(st.st_mode) & 0o777})
                subdirs.append(path)
            elif stat.S_ISLNK(st.st_mode):
                entries.append(_link_entry(root, path, rel, hidden))
            elif stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total > max_bytes:
                    raise ToolError(f"{str(root)!r} holds more than the {max_bytes}-byte transfer cap "
                                    f"(passed it at {rel!r})", {"too_large": True, "max_bytes": max_bytes})
                check_hidden_inode(ctx.policy, st, path, ctx.secrets)  # a hard link to a hidden file
                entries.append(_file_entry(rel, path, st))
            else:
                raise ToolError(f"{str(path)!r} is a special file ({_special(st.st_mode)}): only regular files, "
                                "directories and symlinks within the tree are sent")
        stack.extend(reversed(subdirs))
    return entries


def _special(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "unknown type"


def _link_entry(root: Path, path: Path, rel: str, hidden: HiddenSet) -> dict[str, Any]:
    """A symlink is sent as a link, relative, only when it leads to something inside the tree."""
    target = os.readlink(path)
    lands = real(path)
    if not within(lands, [root]) or hidden.by(lands) is not None:
        raise ToolError(f"{str(path)!r} is a symlink to {target!r}, outside the tree being sent: refused "
                        "(send what it points to instead)")
    relative = os.path.relpath(lands, path.parent)
    return {"path": rel, "type": "symlink", "target": relative}


@tool(tool_type="data_collection", meta=True)
async def transfer_manifest(ctx: ToolContext, path: str, max_bytes: int = 1 << 30) -> dict[str, Any]:
    """Describe a file or directory to send: each entry's relative path, type, size, mode and sha256.

    Returns `{"kind": "file"|"dir", "root", "name", "entries", "total_bytes", "files"}`; a file's one entry
    has the path "". Errors: a hidden or unreadable path (PolicyDenied), a tree holding a hidden path, a
    special file or a symlink leading out of it, more than `max_bytes` of file data (result `too_large`).
    """
    if max_bytes <= 0:
        raise ToolError("max_bytes must be > 0")
    root = _resolve(ctx, path, write=False)

    def describe() -> dict[str, Any]:
        try:
            st = os.stat(root)
        except FileNotFoundError:
            raise ToolError(f"not found: {path}") from None
        if stat.S_ISDIR(st.st_mode):
            fd = open_in(ctx.policy, root, os.O_RDONLY | os.O_DIRECTORY, write=False)  # checked beneath its root
            os.close(fd)
            kind, entries = "dir", _walk(ctx, root, max_bytes)
        elif stat.S_ISREG(st.st_mode):
            if st.st_size > max_bytes:
                raise ToolError(f"{path} is {st.st_size} bytes, more than the {max_bytes}-byte transfer cap",
                                {"too_large": True, "max_bytes": max_bytes})
            check_hidden_inode(ctx.policy, st, root, ctx.secrets)
            kind, entries = "file", [_file_entry("", root, st)]
        else:
            raise ToolError(f"{path} is a special file ({_special(st.st_mode)}): it cannot be sent")
        files = [e for e in entries if e["type"] == "file"]
        return {"kind": kind, "root": str(root), "name": root.name, "entries": entries,
                "total_bytes": sum(e["size"] for e in files), "files": len(files)}

    try:
        return await asyncio.to_thread(describe)
    except PermissionError as exc:
        raise ToolError(f"permission denied: {exc.filename or path}") from None
    except OSError as exc:
        raise ToolError(f"cannot describe {path}: {exc.strerror or exc}") from None


@tool(tool_type="data_collection", meta=True)
async def read_file_chunk(ctx: ToolContext, path: str, offset: int, length: int, size: int) -> dict[str, Any]:
    """Read up to `length` bytes of a file being sent, from `offset`, as base64 (never past `size`, the size
    its manifest gave: a file that grew since is cut at that size and its checksum then tells).

    Returns `{"data", "offset", "length", "eof"}`; the length is also capped by the policy's
    `max_output_bytes` (results travel over the wire), so the caller continues from `offset + length`.
    """
    if offset < 0 or length <= 0 or size < 0 or offset > size:
        raise ToolError("need 0 <= offset <= size and length > 0")
    file = _resolve(ctx, path, write=False)
    length = min(length, size - offset, ctx.policy.max_output_bytes * 3 // 4)
    try:
        fd = open_in(ctx.policy, file, os.O_RDONLY | _NONBLOCK, write=False)
    except (FileNotFoundError, NotADirectoryError):
        raise ToolError(f"not found: {path} (it was removed during the transfer)") from None
    except PermissionError:
        raise ToolError(f"permission denied: {path}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"not a regular file: {path}")
        check_hidden_inode(ctx.policy, st, file, ctx.secrets)
        data = os.pread(fd, length, offset) if length > 0 else b""
    finally:
        os.close(fd)
    if len(data) < length:
        raise ToolError(f"{path} shrank during the transfer (read {offset + len(data)} of {size} bytes)")
    return {"data": base64.b64encode(data).decode("ascii"), "offset": offset, "length": len(data),
            "eof": offset + len(data) >= size}
