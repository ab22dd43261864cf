"""`scan`: what a command changed in its overlay layer, as a list of `Change`s judged against the real tree.

The overlay's upper directory holds new and modified files whole, a deletion as a whiteout, a
directory whose old content was removed as an *opaque* directory; files copied up but left as they
were are no change. Everything here blocks on the filesystem: callers run it on a worker thread.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
from collections import deque
from pathlib import Path
from typing import Literal

from tether.sandbox.layers.filedata import same_data
from tether.sandbox.layers.layer import Change, LayerLimit, LayerLimits, _lstat, _sig

_OPAQUE = ("user.overlay.opaque", "trusted.overlay.opaque")
_ORIGIN = ("user.overlay.origin", "trusted.overlay.origin")  # set on an entry copied up from the real tree
_CHUNK = 1 << 16
_CANDIDATES = 8  # deleted files a created one is compared with, looking for a rename
_PAIR_BYTES = 1 << 30  # content compared in all, looking for renames


def _node(st: os.stat_result) -> Literal["file", "dir", "symlink"]:
    return "dir" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"


def _opaque(path: str) -> bool:
    for name in _OPAQUE:
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _copied_up(path: str) -> bool:
    for name in _ORIGIN:
        with contextlib.suppress(OSError):
            os.getxattr(path, name, follow_symlinks=False)
            return True
    return False


def _same_file(a: str, sa: os.stat_result, b: str, sb: os.stat_result) -> bool:
    if stat.S_ISLNK(sa.st_mode) or stat.S_ISLNK(sb.st_mode):
        return stat.S_ISLNK(sa.st_mode) and stat.S_ISLNK(sb.st_mode) and os.readlink(a) == os.readlink(b)
    if sa.st_size != sb.st_size or stat.S_IMODE(sa.st_mode) != stat.S_IMODE(sb.st_mode):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return same_data(fa.fileno(), fb.fileno(), sa.st_size, _CHUNK)  # holes alike: only the data is read


def _allocated(st: os.stat_result) -> int:
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def _tree_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(base, name)).st_size
    return total


class _Scan:
    def __init__(self, root: str, since_ns: int, limits: LayerLimits, counted: list[int],
                 hidden: frozenset[str] = frozenset()) -> None:
        self.root, self.since_ns, self.limits = root, since_ns, limits
        self.counted = counted  # [changes, bytes] over every root of the layer
        self.hidden = hidden  # whiteouts the warden planted there are not the command's deletions
        self.out: list[Change] = []

    def add(self, change: Change, st: os.stat_result | None = None) -> None:
        change.since_ns = self.since_ns
        self.out.append(change)
        self.counted[0] += 1
        if st is not None and change.kind != "deleted" and stat.S_ISREG(st.st_mode):
            self.counted[1] += _allocated(st)
        files, size = self.limits.files, self.limits.bytes
        if files and self.counted[0] > files:
            raise LayerLimit("limits.layer_files", f"the command changed more than {files} files and directories "
                                                   "(limits.layer_files); nothing was applied")
        if size and self.counted[1] > size:
            raise LayerLimit("limits.layer_bytes", f"the command wrote more than {size} bytes "
                                                   "(limits.layer_bytes); nothing was applied")

    def deleted(self, real: str, st: os.stat_result) -> None:
        size = _tree_bytes(real) if stat.S_ISDIR(st.st_mode) else st.st_size
        self.add(Change(real, "deleted", size, _node(st), self.root, was=_sig(st)))

    def created(self, upper: str, real: str, st: os.stat_result, copied: bool = False) -> None:
        self.add(Change(real, "created", 0 if stat.S_ISDIR(st.st_mode) else st.st_size, _node(st), self.root,
                        source=upper, mode=stat.S_IMODE(st.st_mode), copied=copied), st)
        if stat.S_ISDIR(st.st_mode):
            # names, not DirEntry objects: a directory of 100,000 files keeps no 100,000 objects the
            # garbage collector must walk (its full passes stall every thread, the event loop's too)
            for name in sorted(os.listdir(upper)):
                path = os.path.join(upper, name)
                est = os.lstat(path)
                if stat.S_ISDIR(est.st_mode) or stat.S_ISREG(est.st_mode) or stat.S_ISLNK(est.st_mode):
                    self.created(path, os.path.join(real, name), est)

    def walk(self, upper: str, real: str) -> None:
        names = sorted(os.listdir(upper))
        if _opaque(upper) and os.path.isdir(real):
            kept = set(names)
            for name in sorted(os.listdir(real)):
                st = _lstat(os.path.join(real, name))
                if name not in kept and st is not None:
                    self.deleted(os.path.join(real, name), st)
        for name in names:
            path = os.path.join(upper, name)
            self.entry(path, os.path.join(real, name), os.lstat(path))

    def entry(self, upper: str, real: str, st: os.stat_result) -> None:
        lower = _lstat(real)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            if lower is not None and real not in self.hidden:  # the warden's whiteout over a hidden path
                self.deleted(real, lower)
            return
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return  # fifos, sockets, device nodes: nothing a command should leave in a user's tree
        if lower is not None and stat.S_ISDIR(st.st_mode) and stat.S_ISDIR(lower.st_mode):
            self.walk(upper, real)
            return
        if lower is None:  # copied up: it was there when the command ran, and someone removed it since
            self.created(upper, real, st, copied=_copied_up(upper))
        elif stat.S_ISDIR(lower.st_mode) or stat.S_ISDIR(st.st_mode):
            self.deleted(real, lower)
            self.created(upper, real, st)
        elif not _same_file(upper, st, real, lower):
            self.add(Change(real, "modified", st.st_size, _node(st), self.root, source=upper, was=_sig(lower),
                            mode=stat.S_IMODE(st.st_mode)), st)


def scan(layer: Path, roots: tuple[str, ...], hidden: tuple[str, ...] = (), *, since_ns: int = 0,
         limits: LayerLimits = LayerLimits()) -> list[Change]:
    """Every change the command made under `roots`, parents before children; renames paired up.

    A whiteout at a `hidden` path is the warden's (`mounts.plant_whiteouts`), never a deletion.
    `since_ns`: when the command started (`time.time_ns()` before it ran), kept in each change for
    `conflicts`. Over `limits`, `LayerLimit` at once (the scan stops there; nothing is applied).
    """
    changes: list[Change] = []
    counted = [0, 0]
    hidden_set = frozenset(hidden)
    for i, root in enumerate(roots):
        upper = layer / str(i) / "u"
        if upper.is_dir():
            s = _Scan(root, since_ns, limits, counted, hidden_set)
            s.walk(str(upper), root)
            changes += s.out
    return _pair_renames(changes)


def _pair_renames(changes: list[Change]) -> list[Change]:
    """A deleted file and a created one with the same bytes: a rename (`mv`), journaled as a move.

    Bounded: a created file is compared with at most `_CANDIDATES` deleted ones of its size (one of
    the same name first), and the whole pairing with at most `_PAIR_BYTES` of content, so a command
    that moved 100,000 alike files costs a bounded scan; a move left unpaired is applied (and undone)
    as a deletion and a creation, which ends the same.
    """
    gone: dict[int, deque[Change]] = {}
    named: dict[tuple[int, str], deque[Change]] = {}
    for c in changes:
        if c.kind == "deleted" and c.node == "file":
            gone.setdefault(c.bytes, deque()).append(c)
            named.setdefault((c.bytes, os.path.basename(c.path)), deque()).append(c)
    if not gone:
        return changes
    used: set[int] = set()
    budget = _PAIR_BYTES
    for c in changes:
        if budget <= 0:
            break
        pool = gone.get(c.bytes)
        if not (c.kind == "created" and c.node == "file" and c.source and pool):
            continue
        alike = named.get((c.bytes, os.path.basename(c.path)), deque())
        for line in (pool, alike):  # the heads already paired go: each is looked at once
            while line and id(line[0]) in used:
                line.popleft()
        for d in [*itertools.islice(alike, 1), *itertools.islice(pool, _CANDIDATES)]:
            if id(d) in used:
                continue
            budget -= max(c.bytes, 1)
            if _same_file(c.source, os.lstat(c.source), d.path, os.lstat(d.path)):
                used.add(id(d))
                c.kind, c.moved_from, c.was = "renamed", d.path, d.was
                break
    return [c for c in changes if id(c) not in used]
