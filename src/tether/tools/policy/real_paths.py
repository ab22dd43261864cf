"""Real paths kept between calls: resolved once, then re-checked cheaply before every use.

The policy's hidden paths, protected places and roots are judged by their real path (symlinks resolved),
and a symlink may appear, change or vanish at any time. Resolving them all again for every check costs
far more than the check itself, so `RealPaths` resolves them once and records what resolving them
learned of the filesystem: for each path it looked at, whether it was missing, something other than a
symlink, or a symlink with which target (the *trace*). `os.path.realpath` depends on nothing else, so
when every path of the trace still answers the same (`RealPaths.holds`: one `lstat`, or one `access`
for a missing one, per path), the real paths are still the ones kept; when one does not, they are
resolved again. Nothing is ever trusted because of its age.

`PathMemo` keeps such results per policy, keyed by the entries themselves (and what expanding `~` and a
relative path depends on), so a policy changed or copied never uses another's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

T = TypeVar("T")
# what the trace knows of one path: False missing (lstat failed), True not a symlink, a str: a symlink's target
State = bool | str
_EFFECTIVE = os.access in os.supports_effective_ids
_MAX_KEPT = 32


def _look(path: str, trace: dict[str, State]) -> State:
    if path in trace:
        return trace[path]
    try:
        st = os.lstat(path)
    except OSError:
        state: State = False
    else:
        state = os.readlink(path) if stat.S_ISLNK(st.st_mode) else True
    trace[path] = state
    return state


def _join(path: str, rest: str, seen: dict[str, str | None], trace: dict[str, State]) -> tuple[str, bool]:
    """posixpath._joinrealpath (non-strict), asking `_look` instead of the filesystem directly."""
    if rest.startswith("/"):
        rest, path = rest[1:], "/"
    while rest:
        name, _, rest = rest.partition("/")
        if not name or name == ".":
            continue
        if name == "..":
            if path:
                path, name = os.path.split(path)
                if name == "..":
                    path = os.path.join(path, "..", "..")
            else:
                path = ".."
            continue
        newpath = os.path.join(path, name)
        target = _look(newpath, trace)
        if not isinstance(target, str):
            path = newpath
            continue
        if newpath in seen:  # a link met again: resolved already, or a loop
            known = seen[newpath]
            if known is not None:
                path = known
                continue
            return os.path.join(newpath, rest), False
        seen[newpath] = None
        path, ok = _join(path, target, seen, trace)
        if not ok:
            return os.path.join(path, rest), False
        seen[newpath] = path
    return path, True


def traced_realpath(path: str, trace: dict[str, State]) -> str:
    """`os.path.realpath(path)`, recording in `trace` what it learned of each path it looked at (and
    answering from `trace` for a path already there). Raises OSError only where realpath does (a
    symlink that vanishes between its lstat and its readlink)."""
    resolved, _ = _join("", path, {}, trace)
    return os.path.abspath(resolved)


def trace_holds(trace: Sequence[tuple[str, State]]) -> bool:
    """Whether every path of a trace still answers what it answered (so a realpath that only asked
    them gives the same result now)."""
    for path, state in trace:
        if state is False:
            if os.access(path, os.F_OK, effective_ids=_EFFECTIVE, follow_symlinks=False):
                return False
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return False
        if stat.S_ISLNK(mode):
            if state is True:
                return False
            try:
                if os.readlink(path) != state:
                    return False
            except OSError:
                return False
        elif state is not True:
            return False
    return True


@dataclass(frozen=True, slots=True)
class RealPaths:
    """The real paths of `paths` (in order), with the trace that re-checks them."""

    paths: tuple[str, ...]
    real: tuple[str, ...]
    trace: tuple[tuple[str, State], ...]

    @classmethod
    def of(cls, paths: Sequence[str]) -> RealPaths:
        """Resolve each path as `os.path.realpath` does, sharing the lookups of common parents."""
        trace: dict[str, State] = {}
        real = tuple(traced_realpath(p, trace) for p in paths)
        return cls(tuple(paths), real, tuple(trace.items()))

    def get(self, path: str) -> str:
        """The real path of one of `paths` (KeyError for another)."""
        return self.real[self.paths.index(path)]

    def holds(self) -> bool:
        """Whether resolving `paths` now would give `real` again."""
        return trace_holds(self.trace)


def env_key(entries: Sequence[str]) -> Hashable | None:
    """What expanding `entries` (`~`, a relative path) depends on besides themselves, or None when it
    cannot be told cheaply (`~user`, `~` without $HOME): such entries are resolved at every use."""
    tilde = relative = False
    for entry in entries:  # one pass, no generators: this runs several times per file tool call
        first = entry[:1]
        if first == "/":
            continue
        if first == "~":
            if entry != "~" and not entry.startswith("~/"):
                return None  # ~user
            tilde = True
        else:
            relative = True
    home = os.environ.get("HOME") if tilde else None
    if tilde and not home:
        return None
    return home, os.getcwd() if relative else None


class PathMemo:
    """Values a policy derives from the real paths of its entries (hidden set, protected matcher,
    roots), each kept with the `RealPaths` it was built from and rebuilt when that no longer holds.

    Keyed by content, so copies of a policy may share one memo. Safe to use from several threads: a
    value is replaced whole, and a race only builds it twice. Two memos compare equal (a memo never
    makes two policies differ).
    """

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[RealPaths, Any]] = {}

    def get(self, key: Hashable | None, paths: Callable[[], Sequence[str]], build: Callable[[RealPaths], T]) -> T:
        """`build(RealPaths.of(paths()))`, kept under `key` while its real paths hold; `key` None: not kept."""
        if key is None:
            return build(RealPaths.of(paths()))
        kept = self._kept.get(key)
        if kept is not None and kept[0].holds():
            return cast(T, kept[1])
        resolved = RealPaths.of(paths())
        value = build(resolved)
        if len(self._kept) >= _MAX_KEPT:
            self._kept.clear()
        self._kept[key] = (resolved, value)
        return value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PathMemo)

    __hash__ = None  # type: ignore[assignment]


def memo_of(policy: object) -> PathMemo | None:
    """The policy's memo (None for an object that keeps none: every use then resolves afresh)."""
    private = getattr(policy, "__pydantic_private__", None)  # a slot: cheaper than pydantic's __getattr__
    memo = private.get("_path_memo") if isinstance(private, dict) else None
    return memo if isinstance(memo, PathMemo) else None


def remembered(policy: object, key: Hashable | None, paths: Callable[[], Sequence[str]],
               build: Callable[[RealPaths], T]) -> T:
    """`PathMemo.get` on the policy's memo, or a fresh build when it keeps none."""
    memo = memo_of(policy)
    if memo is None:
        return build(RealPaths.of(paths()))
    return memo.get(key, paths, build)


__all__ = ["PathMemo", "RealPaths", "env_key", "memo_of", "remembered", "trace_holds", "traced_realpath"]
