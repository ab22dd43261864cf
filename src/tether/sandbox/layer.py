"""A command's overlay layer: what it changed (scan), putting that into the real tree (apply), discard.

The overlay's upper directory holds exactly what the command wrote: new and modified files whole,
a deletion as a whiteout (a character device 0/0), a directory whose old content was removed as an
*opaque* directory. `scan` turns that into a list of `Change`s judged against the real tree, leaving
out files copied up but left as they were. `apply` first checks that nothing it would touch changed
in the real tree since the scan (else `ApplyConflict`, nothing applied), then, change by change,
asks `record` to journal it (so undo can put it back) and makes it — through directory fds walked
from the root without following any link, so a symlink planted in the real tree cannot redirect it.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tether.sandbox.fs import parent_beneath

Kind = Literal["created", "modified", "deleted", "renamed"]
# journals a batch of (action, path, dest) before any of it is made
Record = Callable[[list[tuple[str, str, "str | None"]]], None]
_OPAQUE = ("user.overlay.opaque", "trusted.overlay.opaque")
_CHUNK = 1 << 16


class ApplyConflict(RuntimeError):
    """The real tree changed under a captured change since the command ran; nothing was applied."""

    def __init__(self, paths: list[str]) -> None:
        listed = ", ".join(paths[:10]) + (" ..." if len(paths) > 10 else "")
        super().__init__(f"changed since the command ran: {listed}")
        self.paths = paths


@dataclass(slots=True)
class Change:
    path: str
    kind: Kind
    bytes: int
    node: Literal["file", "dir", "symlink"]
    root: str
    source: str | None = None  # the upper-layer entry with the new content
    was: tuple[int, int, int] | None = None  # (inode, size, mtime_ns) of what the real tree held
    moved_from: str | None = None
    mode: int = 0o644
    extra: dict[str, str] = field(default_factory=dict)

    def public(self) -> dict[str, object]:
        out: dict[str, object] = {"path": self.path, "kind": self.kind, "bytes": self.bytes}
        if self.node != "file":
            out["type"] = self.node
        if self.moved_from:
            out["from"] = self.moved_from
        return out


def _sig(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _node(st: os.stat_result) -> Literal["file", "dir", "symlink"]:
    return "dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"


def _opaque(path: str) -> bool:
    for name in _OPAQUE:
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _same_file(a: str, sa: os.stat_result, b: str, sb: os.stat_result) -> bool:
    if stat.S_ISLNK(sa.st_mode) or stat.S_ISLNK(sb.st_mode):
        return stat.S_ISLNK(sa.st_mode) and stat.S_ISLNK(sb.st_mode) and os.readlink(a) == os.readlink(b)
    if sa.st_size != sb.st_size or stat.S_IMODE(sa.st_mode) != stat.S_IMODE(sb.st_mode):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            ca, cb = fa.read(_CHUNK), fb.read(_CHUNK)
            if ca != cb:
                return False
            if not ca:
                return True


def _tree_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(base, name)).st_size
    return total


class _Scan:
    def __init__(self, root: str) -> None:
        self.root = root
        self.out: list[Change] = []

    def deleted(self, real: str, st: os.stat_result) -> None:
        size = _tree_bytes(real) if stat.S_ISDIR(st.st_mode) else st.st_size
        self.out.append(Change(real, "deleted", size, _node(st), self.root, was=_sig(st)))

    def created(self, upper: str, real: str, st: os.stat_result) -> None:
        self.out.append(Change(real, "created", 0 if stat.S_ISDIR(st.st_mode) else st.st_size, _node(st), self.root,
                               source=upper, mode=stat.S_IMODE(st.st_mode)))
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(upper) as entries:
                for e in sorted(entries, key=lambda e: e.name):
                    est = e.stat(follow_symlinks=False)
                    if stat.S_ISDIR(est.st_mode) or stat.S_ISREG(est.st_mode) or stat.S_ISLNK(est.st_mode):
                        self.created(e.path, os.path.join(real, e.name), est)

    def walk(self, upper: str, real: str) -> None:
        with os.scandir(upper) as it:
            entries = sorted(it, key=lambda e: e.name)
        if _opaque(upper) and os.path.isdir(real):
            kept = {e.name for e in entries}
            for name in sorted(os.listdir(real)):
                st = _lstat(os.path.join(real, name))
                if name not in kept and st is not None:
                    self.deleted(os.path.join(real, name), st)
        for e in entries:
            self.entry(e.path, os.path.join(real, e.name), e.stat(follow_symlinks=False))

    def entry(self, upper: str, real: str, st: os.stat_result) -> None:
        lower = _lstat(real)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            if lower is not None:
                self.deleted(real, lower)
            return
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return  # fifos, sockets, device nodes: nothing a command should leave in a user's tree
        if lower is not None and stat.S_ISDIR(st.st_mode) and stat.S_ISDIR(lower.st_mode):
            self.walk(upper, real)
            return
        if lower is None:
            self.created(upper, real, st)
        elif stat.S_ISDIR(lower.st_mode) or stat.S_ISDIR(st.st_mode):
            self.deleted(real, lower)
            self.created(upper, real, st)
        elif not _same_file(upper, st, real, lower):
            self.out.append(Change(real, "modified", st.st_size, _node(st), self.root, source=upper, was=_sig(lower),
                                   mode=stat.S_IMODE(st.st_mode)))


def scan(layer: Path, roots: tuple[str, ...]) -> list[Change]:
    """Every change the command made under `roots`, parents before children; renames paired up."""
    changes: list[Change] = []
    for i, root in enumerate(roots):
        upper = layer / str(i) / "u"
        if upper.is_dir():
            s = _Scan(root)
            s.walk(str(upper), root)
            changes += s.out
    return _pair_renames(changes)


def _pair_renames(changes: list[Change]) -> list[Change]:
    """A deleted file and a created one with the same bytes: a rename (`mv`), journaled as a move."""
    gone = {}
    for c in changes:
        if c.kind == "deleted" and c.node == "file":
            gone.setdefault(c.bytes, []).append(c)
    if not gone:
        return changes
    out: list[Change] = []
    used: set[int] = set()
    for c in changes:
        if c.kind == "created" and c.node == "file" and c.source and c.bytes in gone:
            match = next((d for d in gone[c.bytes] if id(d) not in used
                          and _same_file(c.source, os.lstat(c.source), d.path, os.lstat(d.path))), None)
            if match is not None:
                used.add(id(match))
                c.kind, c.moved_from, c.was = "renamed", match.path, match.was
        out.append(c)
    return [c for c in out if id(c) not in used]


# ---------------------------------------------------------------------------------------- applying


def _conflicts(changes: list[Change]) -> list[str]:
    bad = []
    for c in changes:
        target = c.moved_from if c.kind == "renamed" else c.path
        st = _lstat(target) if target else None
        if c.was is not None and (st is None or _sig(st) != c.was):
            bad.append(target or c.path)
        if c.kind in ("created", "renamed") and _lstat(c.path) is not None \
                and not any(d.kind == "deleted" and d.path == c.path for d in changes):
            bad.append(c.path)
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
    return fn  # type: ignore[no-any-return]


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
        with open(c.source, "rb") as src, open(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
    try:
        os.replace(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=pfd)
        raise


def _journal_entry(c: Change) -> tuple[str, str, str | None]:
    if c.kind == "deleted":
        return ("delete", c.path, None)
    if c.kind == "renamed":
        assert c.moved_from is not None
        return ("move", c.moved_from, c.path)
    return ("mkdir", c.path, None) if c.node == "dir" else ("write", c.path, None)


def apply(changes: list[Change], record: Record) -> None:
    """Journal and make the changes; `ApplyConflict` (nothing done) if the real tree moved meanwhile.

    The whole batch is journaled first (one fsync), then made in order: deletions deepest first,
    new directories, renames, then files.
    """
    bad = _conflicts(changes)
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


def _apply_one(c: Change, parents: dict[str, int]) -> None:
    pfd, name, own = _parent(c, parents)
    try:
        if c.kind == "deleted":
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=pfd)
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
