"""Hidden paths: the policy's `hide_paths`, plus the device's own state directory, token file and config
(which the device always adds), are unreadable, unlistable and uncreatable by every tool: a file tool
refuses them (rule `hide_paths`), a listing of their parent leaves them out, and a hard link to a file in
one is refused like the file. Paths are judged after `realpath`, so no spelling reaches a hidden place
under another name. The protected paths, and the pattern syntax, are in `path_rules`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tether.tools.errors import PolicyDenied
from tether.tools.policy.real_paths import RealPaths, env_key, remembered

if TYPE_CHECKING:
    from tether.tools.policy.model import Policy


# hard links to a hidden file are looked for in at most this many entries of the hidden trees
MAX_INODE_SCAN = 20_000


def _norm(path: str) -> str:
    return path.rstrip("/") or "/"


def _expanded(entry: str) -> str:
    return os.path.abspath(os.path.expanduser(entry))


def hidden_entries(policy: Policy, extra: Iterable[str] = (),
                   realpath: Callable[[str], str] = os.path.realpath) -> list[tuple[str, str]]:
    """(entry as written, absolute form) for each hidden path, expanded and again made real (by
    `realpath`, given the expanded form); the device's own (`extra`) say so in their label."""
    out: list[tuple[str, str]] = []
    named = [(e, e) for e in policy.hide_paths] + [(e, f"{e}, the device's own state directory, token or config")
                                                   for e in extra]
    for entry, label in named:
        if not entry:
            continue
        expanded = _expanded(entry)
        for form in dict.fromkeys((expanded, realpath(expanded))):
            out.append((label, _norm(form)))
    return out


def _under(path: str, root: str) -> bool:
    p, r = path.casefold(), root.casefold()
    return p == r or p.startswith(r.rstrip("/") + "/")


@dataclass(frozen=True, slots=True)
class HiddenSet:
    """The hidden paths resolved once, for judging many paths (a listing, a command's change list)."""

    entries: tuple[tuple[str, str], ...]
    exact: dict[str, str] = field(default_factory=dict)
    seen: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def of(cls, policy: Policy, extra: Iterable[str] = ()) -> HiddenSet:
        """The policy's hidden paths and `extra`, made real now: kept on the policy while their real
        paths hold (`tether.tools.policy.real_paths`), resolved again as soon as one does not."""
        extra = tuple(extra)
        named = [e for e in (*policy.hide_paths, *extra) if e]
        env = env_key(named)

        def build(resolved: RealPaths) -> HiddenSet:
            entries = tuple((entry, form.casefold()) for entry, form in hidden_entries(policy, extra, resolved.get))
            return cls(entries, {form: entry for entry, form in reversed(entries)})

        return remembered(policy, None if env is None else ("hidden", tuple(policy.hide_paths), extra, env),
                          lambda: [_expanded(e) for e in named], build)

    def _scan(self, text: str) -> str | None:
        return next((entry for entry, form in self.entries
                     if text.startswith(form) and (len(text) == len(form) or text[len(form)] == "/" or form == "/")),
                    None)

    def by(self, path: str | os.PathLike[str]) -> str | None:
        """The hidden entry that covers the real path `path` (or None). A path is covered when its
        directory is, or when it is an entry itself; directories are remembered (long change lists)."""
        text = os.fspath(path).casefold()
        directory = text.rpartition("/")[0] or "/"
        if directory not in self.seen:
            if len(self.seen) >= 65536:
                self.seen.clear()
            self.seen[directory] = self._scan(directory)
        return self.seen[directory] or self.exact.get(text.rstrip("/") or "/")

    def inside(self, path: str | os.PathLike[str]) -> str | None:
        """A hidden entry lying inside the directory `path` (deleting or moving it would take that along)."""
        text = os.fspath(path).casefold()
        return next((entry for entry, form in self.entries if _under(form, text)), None)


def hidden_by(policy: Policy, path: str | os.PathLike[str], extra: Iterable[str] = ()) -> str | None:
    """The hidden entry that covers the real path `path` (or None)."""
    return HiddenSet.of(policy, extra).by(path)


def hidden_inside(policy: Policy, path: str | os.PathLike[str], extra: Iterable[str] = ()) -> str | None:
    """A hidden entry lying inside the directory `path` (deleting or moving it would take that along)."""
    return HiddenSet.of(policy, extra).inside(path)


def _denied(entry: str, path: str | os.PathLike[str], shown: str | None = None) -> PolicyDenied:
    where = f"{shown!r} resolves to {os.fspath(path)!r}, which" if shown and shown != os.fspath(path) else \
        f"{os.fspath(path)!r}"
    return PolicyDenied("hide_paths", f"{where} lies in the hidden path {entry!r}: no tool may read, list or "
                                      "create anything there")


def check_hidden(policy: Policy, path: str | os.PathLike[str], extra: Iterable[str] = (),
                 shown: str | None = None, kept: HiddenSet | None = None) -> None:
    """PolicyDenied (rule `hide_paths`) when the real path `path` lies in a hidden path, existing or not.

    `kept`: the `HiddenSet.of(policy, extra)` a caller already took for this same check (one call
    of a tool looks at the hidden paths once); None takes it now."""
    entry = (kept or HiddenSet.of(policy, extra)).by(path)
    if entry is not None:
        raise _denied(entry, path, shown)


def _hidden_files(policy: Policy, extra: Iterable[str]) -> Iterator[tuple[str, os.stat_result]]:
    seen = 0
    for entry, form in hidden_entries(policy, extra):
        if not os.path.isdir(form):
            try:
                yield entry, os.stat(form)
            except OSError:
                pass
            continue
        for base, _dirs, files in os.walk(form):
            for name in files:
                seen += 1
                if seen > MAX_INODE_SCAN:
                    return
                try:
                    yield entry, os.lstat(os.path.join(base, name))
                except OSError:
                    continue


def check_hidden_inode(policy: Policy, st: os.stat_result, path: str | os.PathLike[str],
                       extra: Iterable[str] = ()) -> None:
    """A file with more than one name may be a hard link to a hidden file: refused if it is one."""
    if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
        return
    for entry, other in _hidden_files(policy, extra):
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            raise PolicyDenied("hide_paths", f"{os.fspath(path)!r} is a hard link to a file in the hidden path "
                                             f"{entry!r}: no tool may read or change it")
