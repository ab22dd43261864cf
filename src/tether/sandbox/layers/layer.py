"""A command's overlay layer: what it changed (scan), putting that into the real tree (apply), discard.

The overlay's upper directory holds exactly what the command wrote: new and modified files whole,
a deletion as a whiteout (a character device 0/0), a directory whose old content was removed as an
*opaque* directory. `scan` (in `scan.py`) turns that into a list of `Change`s judged against the real
tree, leaving out files copied up but left as they were, and stops with `LayerLimit` once the layer
holds more changes or bytes than allowed. `apply` first checks that nothing it would touch changed in the real
tree since the command started (`conflicts`: else `ApplyConflict`, nothing applied), then, change
by change, asks `record` to journal it (so undo can put it back) and makes it — through directory
fds walked from the root without following any link, so a symlink planted in the real tree cannot
redirect it.

"Since the command started" is told by the real entry's ctime, which no program can set back: a
path another session created, changed or renamed in after the command's start (`Change.since_ns`)
is a conflict, as is one that changed between the scan and the apply (`Change.was`, its identity
then). Paths are `str` with undecodable bytes kept as lone surrogates (`os.fsdecode`), so every
name round-trips to the same bytes; `Change.public` shows them escaped (`fs.shown`).

Everything here blocks on the filesystem: callers run it on a worker thread, never an event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tether.errors import SandboxError
from tether.sandbox.layers.filedata import copy_data
from tether.sandbox.layers.fs import parent_beneath, shown

Kind = Literal["created", "modified", "deleted", "renamed"]
# journals a batch of (action, path, dest, new content) before any of it is made; the last is the layer's
# file that will replace `path` (for "write"), so the journal can keep only the old size of an append
Record = Callable[[list[tuple[str, str, "str | None", "str | None"]]], None]


class ApplyConflict(SandboxError, RuntimeError):
    """The real tree changed under a captured change since the command started; nothing was applied."""

    def __init__(self, paths: list[str]) -> None:
        listed = ", ".join(shown(p) for p in paths[:10]) + (f" ... ({len(paths)} in all)" if len(paths) > 10 else "")
        super().__init__(f"changed by someone else since the command started: {listed}")
        self.paths = paths


class LateConflict(ApplyConflict):
    """Something was put inside a directory the apply was removing, after the check and before the
    removal reached it: that is kept, the apply stops there, and what it did is journaled."""

    def __init__(self, paths: list[str]) -> None:
        RuntimeError.__init__(self, "changed by someone else while the apply ran: "
                                    + ", ".join(shown(p) for p in paths[:10]))
        self.paths = paths


class LayerLimit(SandboxError, RuntimeError):
    """A command's layer holds more than `rule` allows (`limits.layer_files` or `limits.layer_bytes`)."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(detail)
        self.rule = rule


@dataclass(frozen=True, slots=True)
class LayerLimits:
    """The most one command's layer may hold: changes (files, directories, links, deletions) and bytes
    (allocated on disk, so a sparse file counts what it really uses). 0: no limit."""

    files: int = 0
    bytes: int = 0


@dataclass(slots=True)
class Change:
    path: str
    kind: Kind
    bytes: int
    node: Literal["file", "dir", "symlink"]
    root: str
    source: str | None = None  # the upper-layer entry with the new content
    was: tuple[int, ...] | None = None  # (inode, size, mtime_ns, ctime_ns) of what the real tree held at the scan
    moved_from: str | None = None
    mode: int = 0o644
    extra: dict[str, str] | None = None
    since_ns: int = 0  # when the command started (wall clock, ns): a real entry changed later is a conflict
    copied: bool = False  # the command changed an entry the real tree had (copied up): it must still be there

    def public(self) -> dict[str, object]:
        """What a caller is shown; a name that is not UTF-8 is escaped (`\\xNN`) and flagged `escaped`."""
        path = shown(self.path)
        out: dict[str, object] = {"path": path, "kind": self.kind, "bytes": self.bytes}
        if self.node != "file":
            out["type"] = self.node
        if self.moved_from:
            out["from"] = shown(self.moved_from)
        if path != self.path or (self.moved_from and out["from"] != self.moved_from):
            out["escaped"] = True
        return out


def _sig(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


# ---------------------------------------------------------------------------------------- applying


def _newer_inside(path: str, since_ns: int, most: int = 100) -> list[str]:
    """Paths under the directory `path` changed after `since_ns` (ctime), the first `most` of them."""
    found: list[str] = []
    for base, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            full = os.path.join(base, name)
            st = _lstat(full)
            if st is not None and st.st_ctime_ns > since_ns:
                found.append(full)
                if len(found) >= most:
                    return found
    return found


def _was_matches(was: tuple[int, ...], st: os.stat_result) -> bool:
    now = _sig(st)
    return now[:len(was)] == was  # a note held by an older version has no ctime


Applied = list[tuple[frozenset[str], frozenset[str]]]  # (paths, deleted paths) of each apply made meanwhile


def _ancestors(path: str) -> Iterator[str]:
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return
        yield parent
        path = parent


def _clashes(changes: list[Change], others: Applied) -> list[str]:
    """Where `changes` meet what other applies made since the command started: the same path, a path
    inside what they deleted, or what they made inside a directory these changes delete."""
    if not others:
        return []
    theirs: set[str] = set().union(*(paths for paths, _ in others))
    their_deleted: set[str] = set().union(*(deleted for _, deleted in others))
    ours_deleted = {c.path for c in changes if c.kind == "deleted" and c.node == "dir"}
    bad: list[str] = []
    for c in changes:
        for path in (c.path, c.moved_from):
            if path and (path in theirs or any(a in their_deleted for a in _ancestors(path))):
                bad.append(path)
    if ours_deleted:
        bad += [p for p in theirs if any(a in ours_deleted for a in _ancestors(p))]
    return bad


def applied_paths(changes: list[Change]) -> tuple[list[str], list[str]]:
    """(every path the changes touch, the ones they delete), for `Sandbox.note_applied`."""
    paths = [c.path for c in changes] + [c.moved_from for c in changes if c.moved_from]
    deleted = [c.path for c in changes if c.kind == "deleted"] + [c.moved_from for c in changes if c.moved_from]
    return paths, deleted


def conflicts(changes: list[Change], others: Applied | None = None) -> list[str]:
    """The paths another writer changed since the command started (or since the scan): applying the
    changes would undo theirs. Empty: the real tree is as the command saw it.

    `others`: what this device's other applies made since the command started (exact, where the
    ctime of a change made within a clock tick of the start could be missed)."""
    bad: list[str] = _clashes(changes, others or [])
    deleted_here = {c.path for c in changes if c.kind == "deleted"}
    # a name the command moved is copied up too: with a deletion of that kind in the batch, it may be one
    moved_kinds = {c.node for c in changes if c.kind == "deleted"}
    for c in changes:
        target = (c.moved_from if c.kind == "renamed" else c.path) or c.path
        st = _lstat(target)
        changed = c.was is not None and (st is None or not _was_matches(c.was, st))
        # created, changed or renamed in by someone while the command ran
        changed = changed or bool(c.since_ns and st is not None and c.kind != "created"
                                  and st.st_ctime_ns > c.since_ns)
        if c.kind == "deleted" and st is not None and stat.S_ISDIR(st.st_mode):
            # what someone put inside meanwhile: named, since that is what the deletion would take
            inside = _newer_inside(target, c.since_ns) if c.since_ns else []
            bad += inside or ([target] if changed else [])
        elif changed:
            bad.append(target)
        if c.kind in ("created", "renamed") and c.path not in deleted_here and _lstat(c.path) is not None:
            bad.append(c.path)  # someone made this name while the command ran
        elif c.copied and c.since_ns and c.kind == "created" and c.node not in moved_kinds:
            bad.append(c.path)  # the command changed what was there; someone removed it while it ran
    return bad


def _order(changes: list[Change]) -> Iterator[Change]:
    deletions = [c for c in changes if c.kind == "deleted"]
    yield from sorted(deletions, key=lambda c: -c.path.count("/"))
    yield from (c for c in changes if c.kind == "created" and c.node == "dir")
    yield from (c for c in changes if c.kind == "renamed")
    yield from (c for c in changes if c.kind in ("created", "modified") and c.node != "dir")


AT_FDCWD, RENAME_NOREPLACE = -100, 1


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    return fn


def _rename_new(source: str, pfd: int, name: str) -> None:
    """Move a created file into place in one rename that fails if the name appeared meanwhile."""
    fn = _renameat2()
    if fn is None:
        if os.path.lexists(f"/proc/self/fd/{pfd}/{name}"):
            raise FileExistsError(errno.EEXIST, f"{name} appeared since the command ran")
        os.rename(source, name, dst_dir_fd=pfd)
        return
    if fn(AT_FDCWD, os.fsencode(source), pfd, os.fsencode(name), RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)


def _place(c: Change, pfd: int, name: str) -> None:
    """The upper layer's entry becomes the real one: one rename on the same filesystem (no copy, no
    temporary name: a rename is atomic), a copy beside it and a rename elsewhere."""
    assert c.source is not None
    if c.node != "symlink":
        if c.mode & ~0o777:
            os.chmod(c.source, c.mode & 0o777)  # never a set-uid bit from a sandbox
        try:
            if c.kind == "created":
                _rename_new(c.source, pfd, name)
            else:
                os.replace(c.source, name, dst_dir_fd=pfd)
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
    tmp = f".tether-apply-{os.urandom(6).hex()}"
    if c.node == "symlink":
        os.symlink(os.readlink(c.source), tmp, dir_fd=pfd)
    else:  # another filesystem: copy
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, c.mode & 0o777,
                     dir_fd=pfd)
        try:
            src = os.open(c.source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                copy_data(src, fd)  # holes stay holes
            finally:
                os.close(src)
        finally:
            os.close(fd)
    try:
        os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=pfd)
        raise


def _journal_entry(c: Change) -> tuple[str, str, str | None, str | None]:
    if c.kind == "deleted":
        return ("delete", c.path, None, None)
    if c.kind == "renamed":
        assert c.moved_from is not None
        return ("move", c.moved_from, c.path, None)
    if c.node == "dir":
        return ("mkdir", c.path, None, None)
    return ("write", c.path, None, c.source if c.kind == "modified" and c.node == "file" else None)


def apply(changes: list[Change], record: Record, others: Applied | None = None) -> None:
    """Journal and make the changes; `ApplyConflict` (nothing done) if the real tree moved meanwhile
    (`conflicts`, with `others` as there).

    The whole batch is journaled first (one fsync), then made in order: deletions deepest first,
    new directories, renames, then files.
    """
    bad = conflicts(changes, others)
    if bad:
        raise ApplyConflict(bad)
    ordered = list(_order(changes))
    record([_journal_entry(c) for c in ordered])
    parents: dict[str, int] = {}  # directory fds reused by their files (after the deletions)
    try:
        for c in ordered:
            _apply_one(c, parents)
    finally:
        for fd in parents.values():
            os.close(fd)


def _parent(c: Change, parents: dict[str, int]) -> tuple[int, str, bool]:
    """(fd of the change's directory, its name, whether the caller closes the fd)."""
    if c.kind == "deleted":
        pfd, name = parent_beneath(c.root, c.path)
        return pfd, name, True
    directory, name = os.path.split(c.path)
    if directory not in parents:
        pfd, _ = parent_beneath(c.root, c.path, create=True)
        parents[directory] = pfd
    return parents[directory], name, False


def _remove_tree(parent_fd: int, name: str, path: str, since_ns: int) -> list[str]:
    """Remove the directory `name` with what is in it, following no link, but keep anything whose ctime
    is later than `since_ns` (someone else's, made or changed since the command started: a directory
    whole, since what moved into it keeps its old ctime); returns what was kept."""
    if not since_ns:
        shutil.rmtree(name, dir_fd=parent_fd)
        return []
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    kept: list[str] = []
    try:
        for child in os.listdir(fd):
            st = os.stat(child, dir_fd=fd, follow_symlinks=False)
            full = os.path.join(path, child)
            if st.st_ctime_ns > since_ns:
                kept.append(full)
            elif stat.S_ISDIR(st.st_mode):
                kept += _remove_tree(fd, child, full, since_ns)
            else:
                os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    if not kept:
        os.rmdir(name, dir_fd=parent_fd)
    return kept


def _owner(c: Change, pfd: int, name: str) -> tuple[int, int] | None:
    """Who an entry a root device applies belongs to (docs/security/root.md): what it replaces,
    else the directory it lands in — never the sandbox's run_as user by default, never root by accident."""
    if os.geteuid() != 0 or c.kind not in ("created", "modified"):
        return None
    st = os.stat(name, dir_fd=pfd, follow_symlinks=False) if c.kind == "modified" else os.fstat(pfd)
    return st.st_uid, st.st_gid


def _apply_one(c: Change, parents: dict[str, int]) -> None:
    pfd, name, own = _parent(c, parents)
    owner = _owner(c, pfd, name)
    try:
        if c.kind == "deleted":
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                kept = _remove_tree(pfd, name, c.path, c.since_ns)
                if kept:
                    raise LateConflict(kept)
            else:
                os.unlink(name, dir_fd=pfd)
        elif c.kind == "renamed":
            assert c.moved_from is not None
            sfd, sname = parent_beneath(c.root, c.moved_from, create=False)
            try:
                os.rename(sname, name, src_dir_fd=sfd, dst_dir_fd=pfd)
            finally:
                os.close(sfd)
        elif c.node == "dir":
            os.mkdir(name, c.mode & 0o777, dir_fd=pfd)
        else:
            _place(c, pfd, name)
        if owner is not None:
            os.chown(name, *owner, dir_fd=pfd, follow_symlinks=False)
    finally:
        if own:
            os.close(pfd)


def discard(layer: Path) -> None:
    """Remove a layer; the overlay leaves its work directories mode 000 (`work`, a volatile overlay's
    `work/incompat/volatile`, the ones set aside as `gone-*`), so open them up on the way down first."""
    for base, dirs, _ in os.walk(layer):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(base, name), 0o700)
    shutil.rmtree(layer, ignore_errors=True)
