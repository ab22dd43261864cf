"""One rule for every tool: protected paths, judged on the real path (hidden paths: `hidden`).

*Hidden* paths (the policy's `hide_paths`, plus the device's own state directory, token file and
config, which the device always adds) are unreadable, unlistable and uncreatable by every tool:
a file tool refuses them (rule `hide_paths`), a listing of their parent leaves them out, a command's
captured change under one is refused at apply time, and a live sandboxed process sees them masked.
Their checks are in `tether.tools.policy.hidden`.

*Protected* paths are places whose content another program later runs or loads (shell start-up
files, autostart entries, user units, `.git/hooks`, `.pth` files, MCP clients' configs...). Creating
or changing one, by a file tool or captured from a command, always waits for a person
(`NeedsApproval` with rule `protected-path: <pattern>`), whatever the policy's other approval rules
say. `DEFAULT_PROTECTED` is the list; a policy adds entries with `protected_paths` and drops a
default only by naming it exactly in `unprotect_paths`.

Patterns: one starting with `~` or `/` is anchored there (`~` is the device user's home); any other
matches at any depth (`.git/hooks` is `**/.git/hooks`). `*` and `?` stay within one path component,
`**` spans components, `[...]` is a character class. A pattern matches its path and everything
beneath it. Matching ignores case (a case-insensitive filesystem would let `~/.BASHRC` be
`~/.bashrc`), and an anchored pattern also matches where its directory really lies (a `~/.config`
that is a symlink to a dotfiles checkout). Paths are judged after `realpath`: symlinks, `..` and `~`
are resolved first, so no spelling reaches a hidden or protected place under another name.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tether.tools.errors import NeedsApproval
from tether.tools.policy.hidden import MAX_INODE_SCAN, _norm, _under
from tether.tools.policy.protected_defaults import DEFAULT_PROTECTED
from tether.tools.policy.real_paths import RealPaths, env_key, remembered

if TYPE_CHECKING:
    from tether.tools.policy.model import Policy

_GLOB = re.compile(r"[*?\[]")


def _component(text: str) -> str:
    """One path component of a pattern as a regex: `*` and `?` never cross a `/`."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := text.find("]", i + 2)) != -1:
            body = text[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _body(parts: list[str]) -> str:
    while parts and parts[-1] == "**":
        parts = parts[:-1]  # "beneath" is implied
    out = ""
    for i, part in enumerate(parts):
        if part == "**":
            out += "(?:[^/]+/)*"
        else:
            out += _component(part) + ("/" if i < len(parts) - 1 else "")
    return out


def anchored(pattern: str) -> bool:
    return pattern.startswith(("/", "~"))


def _literal(pattern: str) -> str:
    """An anchored pattern's glob-free leading part, `~` expanded: what is made real."""
    parts = os.path.expanduser(pattern).split("/")
    cut = next((i for i, p in enumerate(parts) if _GLOB.search(p)), len(parts))
    return "/".join(parts[:cut]) or "/"


def anchor_forms(pattern: str, realpath: Callable[[str], str] = os.path.realpath) -> list[str]:
    """An anchored pattern with `~` expanded, and again with its glob-free leading part made real
    (by `realpath`, given the pattern's `_literal`)."""
    expanded = os.path.expanduser(pattern)
    parts = expanded.split("/")
    cut = next((i for i, p in enumerate(parts) if _GLOB.search(p)), len(parts))
    literal = "/".join(parts[:cut]) or "/"
    real = realpath(literal)
    forms = [expanded]
    if real != literal:
        forms.append("/".join([real.rstrip("/") or "", *parts[cut:]]) if cut < len(parts) else real)
    return forms


def _anchored_regex(pattern: str, realpath: Callable[[str], str]) -> str:
    return "|".join("^/" + _body([p for p in form.split("/") if p]) + "(?:/|$)"
                    for form in anchor_forms(pattern, realpath))


def _split_floating(pattern: str) -> tuple[str, str]:
    """A pattern that matches at any depth: (its first component, a regex for the whole of it that
    matches from the start of the component where it begins)."""
    parts = [p for p in pattern.split("/") if p]
    while parts and parts[0] == "**":
        parts = parts[1:]  # any depth is already implied
    return (parts[0] if parts else ""), _body(parts) + "(?:/|$)"


@dataclass(frozen=True, slots=True)
class Matcher:
    """Compiled patterns: `match(path)` is the first pattern that covers a real, absolute path.

    Fast on long change lists (a command's 100,000 new files): a plain anchored pattern is a dict entry
    looked up for each leading part of the path; a pattern that matches at any depth is looked up by
    its first component (a dict for plain names, a short list for globs) and only then matched from
    that component on; only anchored globs are tried one by one.
    """

    places: dict[str, str]
    anchored: tuple[tuple[str, re.Pattern[str]], ...]
    by_name: dict[str, tuple[tuple[str, re.Pattern[str]], ...]]
    by_glob: tuple[tuple[re.Pattern[str], str, re.Pattern[str]], ...]
    seen: dict[str, tuple[str | None, tuple[tuple[int, str, re.Pattern[str]], ...]]] = field(default_factory=dict)

    @classmethod
    def of(cls, patterns: Iterable[str], realpath: Callable[[str], str] = os.path.realpath) -> Matcher:
        """The matcher of `patterns`; `realpath` makes an anchored pattern's leading part real."""
        pats = list(dict.fromkeys(p for p in patterns if p and p.strip("/")))
        places: dict[str, str] = {}
        for p in pats:
            if anchored(p) and not _GLOB.search(p):
                for form in anchor_forms(p, realpath):
                    places.setdefault(_norm(os.path.normpath(form)).casefold(), p)
        fixed = tuple((p, re.compile(_anchored_regex(p, realpath), re.IGNORECASE)) for p in pats
                      if anchored(p) and _GLOB.search(p))
        by_name: dict[str, list[tuple[str, re.Pattern[str]]]] = {}
        by_glob: list[tuple[re.Pattern[str], str, re.Pattern[str]]] = []
        for p in pats:
            if anchored(p):
                continue
            first, body = _split_floating(p)
            if not first:
                continue
            compiled = re.compile(body, re.IGNORECASE)
            if _GLOB.search(first):
                by_glob.append((re.compile(_component(first) + r"\Z", re.IGNORECASE), p, compiled))
            else:
                by_name.setdefault(first.casefold(), []).append((p, compiled))
        return cls(places, fixed, {k: tuple(v) for k, v in by_name.items()}, tuple(by_glob))

    def match(self, path: str | os.PathLike[str]) -> str | None:
        text = os.fspath(path)
        for p, e in self.anchored:
            if e.match(text):
                return p
        directory, _, base = text.rpartition("/")
        hit, starts = self._directory(directory)
        if hit is not None:
            return hit
        for offset, p, body in starts:
            if body.match(text, offset):
                return p
        if not base:
            return None
        hit = self.places.get(text.casefold())
        if hit is not None:
            return hit
        for offset, p, body in self._starts(base, len(directory) + 1):
            if body.match(text, offset):
                return p
        return None

    def _starts(self, component: str, offset: int) -> list[tuple[int, str, re.Pattern[str]]]:
        found = [(offset, p, body) for p, body in self.by_name.get(component.casefold(), ())]
        found += [(offset, p, body) for head, p, body in self.by_glob if head.match(component)]
        return found

    def _directory(self, directory: str) -> tuple[str | None, tuple[tuple[int, str, re.Pattern[str]], ...]]:
        """For a directory: the anchored place it lies in (or None), and where a floating pattern may
        start in it; kept per directory, since a change list holds many entries of the same one."""
        known = self.seen.get(directory)
        if known is not None:
            return known
        folded = directory.casefold()
        hit: str | None = None
        starts: list[tuple[int, str, re.Pattern[str]]] = []
        offset = 0
        for component in directory.split("/"):
            if component:
                end = offset + len(component)
                hit = self.places.get(folded[:end]) if hit is None else hit
                starts += self._starts(component, offset)
            offset += len(component) + 1
        if len(self.seen) >= 65536:
            self.seen.clear()
        self.seen[directory] = (hit, tuple(starts))
        return hit, tuple(starts)


def protected_patterns(policy: Policy) -> list[str]:
    """The defaults (less `unprotect_paths`) and the policy's own `protected_paths`."""
    dropped = set(getattr(policy, "unprotect_paths", ()))
    return [p for p in DEFAULT_PROTECTED if p not in dropped] + list(getattr(policy, "protected_paths", ()))


def _protected(policy: Policy) -> tuple[Matcher, list[tuple[str, str]]]:
    """The protected matcher and anchored places, kept on the policy while the real paths of the
    anchored patterns' leading parts hold (`tether.tools.policy.real_paths`)."""
    patterns = protected_patterns(policy)
    anchors = [p for p in patterns if anchored(p)]
    env = env_key(anchors)

    def build(resolved: RealPaths) -> tuple[Matcher, list[tuple[str, str]]]:
        return Matcher.of(patterns, resolved.get), _places(anchors, resolved.get)

    return remembered(policy, None if env is None else ("protected", tuple(patterns), env),
                      lambda: [_literal(p) for p in anchors], build)


def anchored_places(policy: Policy) -> list[tuple[str, str]]:
    """(pattern, place) for each anchored protected pattern: its glob-free leading part, expanded and
    again made real (`~/.config/autostart`; `~/.cargo/config*` gives `~/.cargo`). These are what a
    live process is kept from writing, and what a new symlink must not redirect."""
    return list(_protected(policy)[1])


def _places(anchors: list[str], realpath: Callable[[str], str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for pattern in anchors:
        for form in anchor_forms(pattern, realpath):
            parts = form.split("/")
            cut = next((i for i, p in enumerate(parts) if _GLOB.search(p)), len(parts))
            place = "/".join(parts[:cut])
            if place and place != "/":
                out.append((pattern, _norm(place)))
    return out


def protected_inside(policy: Policy, path: str | os.PathLike[str],
                     places: list[tuple[str, str]] | None = None) -> str | None:
    """`protected-path: <pattern>` when an anchored protected place lies inside `path` (a symlink put
    there, or a directory deleted there, would change what is found at that place)."""
    text = os.fspath(path)
    return next((f"protected-path: {pattern}" for pattern, place in (places or anchored_places(policy))
                 if place != _norm(text) and _under(place, text)), None)


def protected_matcher(policy: Policy) -> Matcher:
    """The matcher of the policy's protected patterns (kept while their real places hold)."""
    return _protected(policy)[0]


GIT_POINTER = ".git"  # the rule a `.git` file or symlink is held under (see `git_pointer`)


def git_pointer(policy: Policy, path: str | os.PathLike[str], node: str | None = None) -> bool:
    """Whether `path` is a `.git` that is not a directory: a file (`gitdir: <dir>`, what `git init
    --separate-git-dir` and every submodule checkout write) or a symlink, which makes git take another
    directory, one no `.git/...` pattern names, as the repository, and so run its `config`
    (`core.fsmonitor`) and `hooks` at the user's next `git status`. `node` is the entry's kind
    ("file", "dir", "symlink") when known (a captured change); otherwise the path is looked at, and
    one that does not exist yet counts as a file (a file tool is about to create it). Held while
    `.git/config` is protected (unprotecting that opens this too)."""
    if os.path.basename(os.fspath(path)).casefold() != GIT_POINTER:
        return False
    if node is None:
        try:
            node = "dir" if stat.S_ISDIR(os.lstat(path).st_mode) else "file"
        except OSError:
            node = "file"
    return node != "dir" and ".git/config" not in getattr(policy, "unprotect_paths", ())


GIT_DIRECTORY = "git directory"  # the rule for `config` and `hooks` of a repository not named .git


_REPO_PROGRAMS = ("config", "config.worktree")  # and anything under `hooks`
_REPO_MARKS = ("head", "objects", "refs")  # what makes a directory a repository to git


def git_directory_file(policy: Policy, path: str | os.PathLike[str],
                       exists: Callable[[str], bool] = os.path.lexists) -> bool:
    """Whether `path` is the `config`, `config.worktree` or (something under) `hooks` of a directory git
    takes as a repository whatever its name: one holding `HEAD` and `objects` or `refs` (`git init
    --bare evil.git`, the directory a `.git` file points to); or a *new* `HEAD`, `objects` or `refs`
    that makes a directory already holding a `config` or `hooks` such a repository (so the order the
    pieces are made in changes nothing; a `HEAD` rewritten by a checkout is not new). git runs that
    config's `core.fsmonitor` at a `git status` inside it (a shell prompt showing git's state runs one
    on `cd`). `exists` says whether a path exists (a captured command's own new entries count: `capture`
    passes them in); `path` itself counts. Held while `.git/config` is protected."""
    text = os.fspath(path)
    lowered = text.casefold()
    base = lowered.rpartition("/")[2]
    if base not in _REPO_PROGRAMS and base not in _REPO_MARKS and "/hooks" not in lowered:
        return False  # most paths: one look, no split
    if ".git/config" in getattr(policy, "unprotect_paths", ()):
        return False

    def there(entry: str) -> bool:
        return entry == text or exists(entry)

    def repository(d: str) -> bool:
        return bool(d) and there(f"{d}/HEAD") and (there(f"{d}/objects") or there(f"{d}/refs"))

    parts, folded = text.split("/"), lowered.split("/")
    if base in _REPO_PROGRAMS and repository("/".join(parts[:-1])):
        return True
    if "hooks" in folded[:-1] or base == "hooks":
        at = len(folded) - 1 - folded[::-1].index("hooks")
        if repository("/".join(parts[:at])):
            return True
    if base in _REPO_MARKS and not os.path.lexists(text):
        d = "/".join(parts[:-1])
        return repository(d) and (there(f"{d}/config") or there(f"{d}/hooks"))
    return False


def protected_rule(policy: Policy, path: str | os.PathLike[str], matcher: Matcher | None = None,
                   node: str | None = None, exists: Callable[[str], bool] = os.path.lexists) -> str | None:
    """`protected-path: <pattern>` when `path` (real, absolute) is protected, else None; a `.git` that
    is not a directory is `protected-path: .git` (`git_pointer`; `node` as there), and the config or
    hooks of a repository under another name `protected-path: git directory` (`git_directory_file`;
    `exists` as there)."""
    pattern = (matcher or protected_matcher(policy)).match(path)
    if pattern is not None:
        return f"protected-path: {pattern}"
    lowered = os.fspath(path).casefold()  # one look decides for almost every path
    if lowered.endswith("/.git") and git_pointer(policy, path, node):
        return f"protected-path: {GIT_POINTER}"
    if (lowered.endswith(("/config", "/config.worktree", "/head", "/objects", "/refs")) or "/hooks" in lowered) \
            and git_directory_file(policy, path, exists):
        return f"protected-path: {GIT_DIRECTORY}"
    return None


def require_person(policy: Policy, paths: Iterable[str | os.PathLike[str]], what: str, approved_by: str | None,
                   matcher: Matcher | None = None) -> None:
    """NeedsApproval naming the protected rule when any of `paths` is protected and nobody approved."""
    if approved_by:
        return
    matcher = matcher or protected_matcher(policy)
    for path in paths:
        rule = protected_rule(policy, path, matcher)
        if rule is not None:
            raise NeedsApproval(rule, f"{what}: {str(path)!r} is a protected path (another program later runs or "
                                      "loads what is there), so a person decides, whatever the other rules say")


def tree_paths(root: Path, limit: int = MAX_INODE_SCAN) -> Iterator[Path] | None:
    """Every path inside the directory `root` (not following links), or None when there are more than `limit`."""
    found: list[Path] = []
    for base, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            found.append(Path(base) / name)
            if len(found) > limit:
                return None
    return iter(found)


__all__ = [
    "DEFAULT_PROTECTED", "GIT_DIRECTORY", "GIT_POINTER", "Matcher", "anchored", "anchored_places", "git_directory_file",
    "git_pointer", "protected_inside",
    "protected_matcher", "protected_patterns", "protected_rule", "require_person", "tree_paths",
]
