"""Putting one journal entry back: beneath the write root each path lies in, no symlink followed.

The `_put_*_back`, `_cut_back`, `_move_back`, `_remove_created` and `_outside` functions return (the
outcome's words, whether the entry counts as undone); a path that changed since (a link planted, a
file replaced) is reported as a conflict and left as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tether.sandbox.layers.filedata import copy_data
from tether.sandbox.layers.fs import copy_entry, move_entry, open_beneath, parent_beneath
from tether.tools.journal.copies import _CHUNK, _digest


def _cut_back(root: str, path: str, entry: dict[str, Any]) -> tuple[str, bool]:
    """Undo an append: the file is cut back to its old size, once the added bytes are found still there."""
    fd = open_beneath(root, path, os.O_RDWR)  # no symlink followed, the last component included
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "conflict: something other than a file now stands there; left as is", False
        if st.st_size == entry["size"]:
            return "restored (already at its old size)", True  # a restore that stopped before marking it
        if st.st_size != entry["new_size"] or _digest(fd, entry["size"], st.st_size) != entry["tail"]:
            return (f"conflict: the file changed after the append ({st.st_size} bytes, expected "
                    f"{entry['new_size']}); left as is"), False
        os.ftruncate(fd, entry["size"])
        os.chmod(fd, entry["mode"])
        os.utime(fd, ns=(entry["mtime_ns"], entry["mtime_ns"]))
        os.fsync(fd)
    finally:
        os.close(fd)
    return "restored", True


def _jails(roots: Sequence[str] | None) -> list[str]:
    """The real paths of the roots, outermost first (a path is put back beneath the outermost one it is in)."""
    if roots is None:
        return ["/"]
    return sorted({os.path.realpath(os.path.expanduser(r)) for r in roots}, key=len)


def _jail_of(path: str, jails: list[str]) -> str | None:
    return next((j for j in jails if path == j or path.startswith(j.rstrip("/") + "/")), None)


def _outside(path: str, jails: list[str]) -> tuple[str, bool]:
    return (f"refused: {path} lies outside the write roots {jails}; left as is "
            "(undo with the policy whose write roots allowed the change)"), False


@contextlib.contextmanager
def _parent(root: str, path: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """`path`'s directory (an fd) and name, reached beneath `root` without following a link."""
    fd, name = parent_beneath(root, path, create=create, mode=0o777)
    try:
        yield fd, name
    finally:
        os.close(fd)


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _exists(root: str, path: str) -> bool:
    try:
        with _parent(root, path) as (fd, name):
            return _lstat_at(fd, name) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False


def _put_file_back(blob: Path, root: str, path: str, entry: dict[str, Any]) -> tuple[str, bool]:
    """Write the saved bytes beside the target and rename over it, so a reader never sees a mix
    (and a symlink that now stands there is replaced, not written through)."""
    with _parent(root, path, create=True) as (dir_fd, name):
        now = _lstat_at(dir_fd, name)
        if now is not None and stat.S_ISDIR(now.st_mode):
            return "conflict: a directory now stands where the file was", False
        tmp = f".tether-undo-{uuid.uuid4().hex}"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            if _copy_checked(blob, out, entry) != entry.get("digest", entry.get("sha256")):
                os.unlink(tmp, dir_fd=dir_fd)
                return "failed: the saved copy is corrupt (checksum mismatch); file left as is", False
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
    return "restored", True


def _copy_checked(blob: Path, out: int, entry: dict[str, Any]) -> str:
    """Copy the blob into the open fd `out` (closed here) with its mode and mtime, holes kept; returns
    the blob's checksum in the form the entry has (`digest`, or a whole-file sha256 from older entries)."""
    try:
        source = os.open(blob, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if "digest" in entry:
                digest = _digest(source)
            else:
                whole = hashlib.sha256()
                while chunk := os.read(source, _CHUNK):
                    whole.update(chunk)
                digest = whole.hexdigest()
            copy_data(source, out)
        finally:
            os.close(source)
        os.chmod(out, entry["mode"])
        os.utime(out, ns=(entry["mtime_ns"], entry["mtime_ns"]))
        os.fsync(out)
    finally:
        os.close(out)
    return digest


def _put_link_back(root: str, path: str, link: str) -> tuple[str, bool]:
    with _parent(root, path, create=True) as (dir_fd, name):
        now = _lstat_at(dir_fd, name)
        if now is not None and stat.S_ISDIR(now.st_mode):
            return "conflict: a directory now stands where the symlink was", False
        tmp = f".tether-undo-{uuid.uuid4().hex}"
        os.symlink(link, tmp, dir_fd=dir_fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return "restored", True


def _put_dir_back(blob: Path, root: str, path: str, mode: int) -> tuple[str, bool]:
    """Copy the saved tree into place (merging into a directory that is there again), following no link."""
    with _parent(root, path, create=True) as (dir_fd, name):
        now = _lstat_at(dir_fd, name)
        if now is not None and not stat.S_ISDIR(now.st_mode):
            return "conflict: something other than a directory now stands there", False
        blobs = os.open(blob.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            copy_entry(blobs, blob.name, dir_fd, name, merge=True)
        finally:
            os.close(blobs)
    fd = open_beneath(root, path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.chmod(fd, mode)
    finally:
        os.close(fd)
    return "restored", True


def _remove_created(root: str, path: str) -> tuple[str, bool]:
    try:
        with _parent(root, path) as (dir_fd, name):
            now = _lstat_at(dir_fd, name)
            if now is None:
                return "already_absent", True
            if not stat.S_ISDIR(now.st_mode):
                os.unlink(name, dir_fd=dir_fd)
                return "removed", True
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError:
                return "kept: the directory is not empty", False
            return "removed", True
    except (FileNotFoundError, NotADirectoryError):
        return "already_absent", True


def _move_back(root: str, source: str, dest_root: str, dest: str) -> tuple[str, bool]:
    if not _exists(dest_root, dest):
        if _exists(root, source):
            return "moved_back", True  # a previous restore got this far before stopping
        return f"failed: {dest} no longer exists", False
    if _exists(root, source):
        return f"conflict: {source} exists again; {dest} left in place", False
    with _parent(dest_root, dest) as (dest_fd, dest_name), _parent(root, source, create=True) as (src_fd, src_name):
        move_entry(dest_fd, dest_name, src_fd, src_name)
    return "moved_back", True
