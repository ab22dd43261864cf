"""Hidden and protected paths inside the roots a live process writes directly (nothing is captured there).

A captured command's changes are judged when they are applied; a live process (a sandboxed stdio MCP
server, a launched application, any command's `live_write_roots`) writes at once, so what it must
not create has to be made uncreatable in its view of the machine:

- an existing hidden path is masked (`bwrap.hide_args`, the warden's own masks);
- an existing protected path is bound read-only over itself;
- a hidden or protected path that does not exist yet cannot be given a mount point without creating
  it on the machine (an empty `~/.bash_profile` would change what bash reads), so its nearest existing
  ancestor is *frozen*: that directory's own level is bound read-only (no new name can appear in it,
  none can be removed or renamed) and each directory and regular file already in it is bound back
  writable, so everything below keeps working as before. A directory with more than `MAX_CHILDREN`
  entries is frozen whole (read-only).

Pure planning from paths (plus a look at what exists); standard library only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tether.sandbox.confine.spec import under

MAX_CHILDREN = 512
MAX_SCAN = 2000
MountCall = Callable[[str | None, str, str | None, int, str | None], object]


@dataclass(frozen=True, slots=True)
class LivePlan:
    """`freeze`: (directory, the entries bound back writable); `readonly`: paths bound read-only over themselves.

    Apply in this order — freezes outermost first, then the read-only binds, then the hidden masks —
    so an inner rule lands on top of an outer one.
    """

    freeze: tuple[tuple[str, tuple[str, ...]], ...] = ()
    readonly: tuple[str, ...] = ()

    def bwrap_args(self, reaches: Callable[[str], bool] = lambda _: True) -> list[str]:
        """The plan as bubblewrap arguments (bwrap reads every source from the machine's own tree). `reaches(path)`:
        whether bwrap, as the user it starts as, can look `path` up; what it cannot reach is left out (the
        sandboxed process cannot reach it either, and bwrap would fail to start on it: another user's 0700
        directory under a shared write root). A file or entry that is gone by the time bwrap looks (removed by
        another process since the plan) is skipped (`--ro-bind-try`, `--bind-try`); a frozen directory is not."""
        args: list[str] = []
        for directory, children in self.freeze:
            if not reaches(directory):
                continue
            args += ["--ro-bind", directory, directory]
            for name in children:
                path = os.path.join(directory, name)
                args += ["--bind-try", path, path]
        for path in self.readonly:
            if reaches(path):
                args += ["--ro-bind-try", path, path]
        return args


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _children(directory: str, skip: set[str]) -> tuple[str, ...] | None:
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return ()
    if len(names) > MAX_CHILDREN:
        return None
    kept = []
    for name in names:
        path = os.path.join(directory, name)
        if path in skip:
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
            kept.append(name)
    return tuple(kept)


def _floating(roots: list[str], names: Iterable[str], depth: int, skip: set[str]) -> set[str]:
    """Existing `names` (relative paths such as `.git/config`) in each root and the directories up to
    `depth` levels below it (no links followed, at most `MAX_SCAN` directories looked at)."""
    wanted: dict[str, list[str]] = {}
    for name in names:
        wanted.setdefault(name.split("/", 1)[0], []).append(name)
    found: set[str] = set()
    todo = [(r, 0) for r in roots]
    looked = 0
    while todo and looked < MAX_SCAN:
        directory, level = todo.pop()
        looked += 1
        try:
            with os.scandir(directory) as entries:
                listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        except OSError:
            continue
        for name, is_dir in listed:
            path = os.path.join(directory, name)
            if path in skip:
                continue
            for rel in wanted.get(name, ()):
                target = os.path.join(directory, rel)
                if os.path.lexists(target) and not os.path.islink(target):
                    found.add(target)
            if is_dir and level < depth:
                todo.append((path, level + 1))
    return found


def live_plan(writable: Iterable[str], hidden: Iterable[str], protected: Iterable[str],
              floating: Iterable[str] = (), depth: int = 0) -> LivePlan:
    """What to bind so that, under the `writable` roots (real paths), no hidden or protected path can be
    created or changed. `hidden` and `protected` are real absolute paths; existing hidden paths are
    left to the masks. `floating` are protected names that may lie at any depth (`.git/config`): the
    existing ones in each root and up to `depth` levels below it are bound read-only (a missing one
    has no place to guard: see docs/security/protected-paths.md)."""
    roots = [r for r in writable if os.path.isdir(r)]
    hidden_set = {h for h in hidden if under(h, roots)}
    protected_set = {p for p in protected if under(p, roots)}
    readonly: set[str] = _floating(roots, floating, depth, hidden_set) if floating else set()
    frozen: set[str] = set()
    for target in sorted(hidden_set | protected_set):
        if os.path.lexists(target):
            if target not in hidden_set:
                readonly.add(target)
            continue
        ancestor = _nearest_existing(target)
        if os.path.isdir(ancestor) and not os.path.islink(ancestor) and under(ancestor, roots):
            frozen.add(ancestor)
    skip = readonly | {h for h in hidden_set if os.path.lexists(h)}
    freeze: list[tuple[str, tuple[str, ...]]] = []
    for directory in sorted(frozen, key=lambda d: (d.count("/"), d)):
        children = _children(directory, skip)
        freeze.append((directory, children or ()))
    return LivePlan(tuple(freeze), tuple(sorted(readonly, key=lambda p: (p.count("/"), p))))


_ST_KEPT = 2 | 4 | 8 | 1024 | 2048  # nosuid, nodev, noexec, noatime, nodiratime: same bits as MS_*
_ST_RELATIME, _MS_RELATIME = 4096, 1 << 21
_MS_BIND, _MS_REMOUNT, _MS_RDONLY, _MS_REC = 4096, 32, 1, 16384


def _readonly(mount: MountCall, path: str) -> None:
    """Bind `path` over itself, then make that bind read-only, keeping the flags the kernel locks."""
    mount(path, path, None, _MS_BIND | _MS_REC, None)
    flags = os.statvfs(path).f_flag
    kept = (flags & _ST_KEPT) | (_MS_RELATIME if flags & _ST_RELATIME else 0)
    mount(None, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | kept, None)


def mount_plan(mount: MountCall, freeze: Iterable[tuple[str, Iterable[str]]], readonly: Iterable[str]) -> None:
    """Carry out a `LivePlan` in the current mount namespace (the warden's command process), with
    `mount(source, target, fstype, flags, data)`. Each entry bound back writable is opened before its
    directory turns read-only: a bind of it then copies the writable mount, not the read-only one."""
    for directory, names in freeze:
        if not os.path.isdir(directory):
            continue
        kept: list[tuple[str, int]] = []
        for name in names:
            try:
                kept.append((name, os.open(os.path.join(directory, name), os.O_PATH | os.O_NOFOLLOW)))
            except OSError:
                continue
        try:
            _readonly(mount, directory)
            for name, fd in kept:
                mount(f"/proc/self/fd/{fd}", os.path.join(directory, name), None, _MS_BIND | _MS_REC, None)
        finally:
            for _, fd in kept:
                os.close(fd)
    for path in readonly:
        if os.path.lexists(path):
            _readonly(mount, path)
