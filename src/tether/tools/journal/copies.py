"""The undo journal's saved copies: copied with holes kept, synced, and their block checksums.

`_digest` ("zsha256:...") is taken over the non-zero 4 KiB blocks and their offsets, so it costs what
the data costs, not what the size says; `_grown` describes an append to a file of at least
`GROWN_MIN` bytes by its old size and the checksum of the added bytes instead of a copy.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from tether.sandbox.layers.filedata import copy_data, data_segments, same_data
from tether.sandbox.layers.fs import copy_entry

_CHUNK = 1 << 20
_BLOCK = 4096
GROWN_MIN = 1 << 20  # an append to a file at least this big keeps only its old size (a smaller one is copied)
_ZEROS = bytes(_CHUNK)


def _copy_synced(src: Path, dst: Path) -> tuple[str, int]:
    """Copy (holes kept), hash and fsync: a journal entry must never point at a half-written copy."""
    source = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # the file that was lstat'ed, not a link
    try:
        out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            size = copy_data(source, out)
            os.fsync(out)
            return _digest(out), size
        finally:
            os.close(out)
    finally:
        os.close(source)


def _digest(fd: int, begin: int = 0, size: int | None = None) -> str:
    """sha256 over (offset, bytes) of each 4 KiB block of `fd` that is not all zeros, and the size: the
    same for the same content however its holes lie, and read only where there is data. `begin`,
    `size`: only the bytes from `begin` up to `size` (blocks then counted from `begin`)."""
    if size is None:
        size = os.fstat(fd).st_size
    digest = hashlib.sha256(b"zsha256\0%d\0" % size + (b"from\0%d\0" % begin if begin else b""))
    done = begin  # blocks before this offset are hashed (two stretches may share a block)
    for start, length in data_segments(fd, size):
        if start + length <= begin:
            continue
        pos = max(begin + max(0, start - begin) // _BLOCK * _BLOCK, done)  # blocks counted from `begin`
        end = start + length
        while pos < end:
            chunk = os.pread(fd, min(_CHUNK, end - pos + (-(end - pos)) % _BLOCK), pos)
            if not chunk:
                break
            if chunk != _ZEROS[:len(chunk)]:
                for i in range(0, len(chunk), _BLOCK):
                    block = chunk[i:i + _BLOCK]
                    if block.count(0) != len(block):
                        digest.update(b"%d\0" % (pos + i))
                        digest.update(block)
            pos += len(chunk)
        done = max(done, pos)
    return "zsha256:" + digest.hexdigest()


def _grown(target: str, new: str) -> dict[str, Any] | None:
    """The entry for an append: `new` (the file that will replace `target`) is `target` with bytes added
    at its end, and `target` is big enough for that to be worth a comparison. None: save a copy."""
    try:
        old = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(old)
        if not stat.S_ISREG(st.st_mode) or st.st_size < GROWN_MIN:
            return None
        try:
            added = os.open(new, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            now = os.fstat(added)
            if now.st_size <= st.st_size or not same_data(old, added, st.st_size, _CHUNK):
                return None
            tail = _digest(added, st.st_size, now.st_size)
        finally:
            os.close(added)
    finally:
        os.close(old)
    return {"mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns, "kind": "grown", "size": st.st_size,
            "new_size": now.st_size, "tail": tail}


def _copy_tree(target: Path, blobs: Path, name: str) -> None:
    parent = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        into = os.open(blobs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            copy_entry(parent, target.name, into, name)
        finally:
            os.close(into)
    finally:
        os.close(parent)
