"""The path jail: every path a tool touches is resolved (symlinks, `..`, `~`) and then checked.

Checking the resolved path, not the string, is what stops `root/../etc` and a symlink that points
out of the allowed roots. A path that does not exist yet is resolved through its nearest existing
parent, so a new file under a symlinked directory is judged by where it would really land. The
tools then open the checked path beneath its root (`open_in`, `parent_in`), so a symlink swapped in
after the check is refused rather than followed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

from tether.sandbox.layers.fs import EscapeError, open_beneath, parent_beneath
from tether.tools.errors import PolicyDenied
from tether.tools.policy.hidden import HiddenSet, check_hidden
from tether.tools.policy.model import Policy
from tether.tools.policy.path_rules import Matcher, protected_rule
from tether.tools.policy.real_paths import RealPaths, env_key, remembered


def _absolute(path: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None) -> Path:
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_absolute():
        p = Path(cwd if cwd is not None else os.getcwd()).expanduser() / p
    return p


def real(path: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None) -> Path:
    """The real path of `path` (`~` expanded, a relative one taken from `cwd` or the current directory)."""
    text = os.path.expanduser(os.fspath(path))
    if text == "/" or (text.startswith("/") and "//" not in text[1:] and "/." not in text and not text.endswith("/")):
        return Path(os.path.realpath(text))  # already as a Path would write it: no Path built to normalize it
    return Path(os.path.realpath(_absolute(path, cwd)))


def real_all(policy: Policy, paths: Sequence[str]) -> tuple[Path, ...]:
    """`real(p)` for each of `paths` (the policy's roots, the temp or state directory), kept on the
    policy while their real paths hold (`tether.tools.policy.real_paths`): a root replaced by a
    symlink, or a link on its way changed, is resolved again before it is used."""
    env = env_key(paths)

    def build(resolved: RealPaths) -> tuple[Path, ...]:
        return tuple(Path(p) for p in resolved.real)

    return remembered(policy, None if env is None else ("real", tuple(paths), env),
                      lambda: [str(_absolute(p)) for p in paths], build)


def _roots(policy: Policy, roots: list[str]) -> tuple[Path, ...]:
    return real_all(policy, roots)


def within(path: Path, roots: Sequence[Path]) -> bool:
    """Whether the absolute, normalized `path` is one of `roots` or lies beneath one."""
    text = str(path)
    return any(text == (r := str(root)) or text.startswith(r.rstrip("/") + "/") for root in roots)


def resolve_path(policy: Policy, path: str, *, write: bool, cwd: str | None = None,
                 hidden: Iterable[str] = (), hidden_set: HiddenSet | None = None) -> Path:
    """The real path of `path` if the policy lets a tool read (or write) it; else `PolicyDenied`.

    A path inside a hidden path (the policy's `hide_paths` and `hidden`, the device's own secrets) is
    refused (rule `hide_paths`) whether or not it exists, after symlinks and `..` are resolved.
    `hidden_set`: `HiddenSet.of(policy, hidden)` when the caller took it for this call already.
    """
    if not isinstance(path, str) or not path or "\x00" in path:
        raise PolicyDenied("path.invalid", f"not a usable path: {path!r}")
    resolved = real(path, cwd)
    check_hidden(policy, resolved, hidden, shown=path, kept=hidden_set)
    rule, roots = ("write_roots", policy.write_roots) if write else ("read_roots", policy.read_roots)
    if not within(resolved, _roots(policy, roots)):
        raise PolicyDenied(rule, f"{path!r} resolves to {str(resolved)!r}, outside the allowed roots {roots}")
    return resolved


def check_cwd(policy: Policy, cwd: str | None, hidden: Iterable[str] = ()) -> Path:
    """`shell.run` must say where it runs, and that place must lie inside the roots (seed 004)."""
    if not cwd:
        raise PolicyDenied("cwd.required", "cwd is required: give an absolute directory inside the allowed roots")
    resolved = resolve_path(policy, cwd, write=False, hidden=hidden)
    if not resolved.is_dir():
        raise PolicyDenied("cwd.exists", f"cwd {cwd!r} is not an existing directory")
    return resolved


def approval_needed(policy: Policy, action: Literal["delete", "move", "overwrite"], path: Path,
                    temp_dir: str, matcher: Matcher | None = None) -> str | None:
    """The rule that makes this action wait for a person, or None when it may go ahead: a protected path
    (`protected-path: <pattern>`) always, then the policy's `approval` rules."""
    protected = protected_rule(policy, path, matcher)
    if protected is not None:  # always a person, whatever `approval` says (see tether.tools.policy.path_rules)
        return protected
    rules = policy.approval
    in_temp = within(path, real_all(policy, (temp_dir,)))
    if action == "delete" and rules.delete and not in_temp:
        return "approval.delete"
    if action == "move" and rules.move and not in_temp:
        return "approval.move"
    if action == "overwrite" and rules.overwrite_outside_temp and not in_temp:
        return "approval.overwrite_outside_temp"
    return None


# ---------------------------------------------------------------- the path checked is the path used
#
# `resolve_path` judges where a path leads *now*; whoever can write inside the roots can swap a
# component for a symlink a moment later. So every tool opens what it checked beneath the root it
# lies in, through `tether.sandbox.layers.fs`: no component may then be a symlink, and one swapped in is
# refused (`path.escape`) instead of being followed.


def root_of(policy: Policy, path: Path, *, write: bool) -> Path:
    """The outermost allowed root `path` lies in: opens start there, so every component below it is
    walked without following links (the root's own ancestors lie outside what a tool may change)."""
    roots = policy.write_roots if write else policy.read_roots
    inside = [root for root in _roots(policy, roots) if within(path, [root])]
    if not inside:
        rule = "write_roots" if write else "read_roots"
        raise PolicyDenied(rule, f"{str(path)!r} lies outside the allowed roots {roots}")
    return min(inside, key=lambda root: len(root.parts))


def escaped(exc: EscapeError) -> PolicyDenied:
    return PolicyDenied("path.escape", f"{exc}: the path changed after it was checked (a symlink put in its way?), "
                                       "so nothing was done; look at what is there now and retry")


def open_in(policy: Policy, path: Path, flags: int, *, write: bool, mode: int = 0o600) -> int:
    """An fd for the checked `path`, opened beneath its root with no symlink followed; the caller closes it."""
    try:
        return open_beneath(str(root_of(policy, path, write=write)), str(path), flags, mode)
    except EscapeError as exc:
        raise escaped(exc) from None


def parent_in(policy: Policy, path: Path, *, write: bool, create: bool = False) -> tuple[int, str]:
    """(fd of `path`'s directory, its name) beneath its root, for `dir_fd=` calls; the caller closes the fd.

    `create` makes missing directories on the way (never through a link), as `mkdir` would.
    """
    try:
        return parent_beneath(str(root_of(policy, path, write=write)), str(path), create=create, mode=0o777)
    except EscapeError as exc:
        raise escaped(exc) from None


def open_at(dir_fd: int, name: str, flags: int, shown: Path, mode: int = 0o600) -> int:
    """`name` in a directory fd from `parent_in`, never through a symlink (one found is `path.escape`)."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise escaped(EscapeError(str(shown), "is now a symlink; refusing to follow it")) from None
        raise


def lstat_in(policy: Policy, path: Path, *, write: bool) -> os.stat_result | None:
    """What stands at `path` now (a symlink itself, not its target), looked at through the jail; None if nothing."""
    root = root_of(policy, path, write=write)  # once: the root judged is the root opened from, here at once
    try:
        if path == root:
            fd = open_beneath(str(root), str(path), getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)
            try:
                return os.fstat(fd)
            finally:
                os.close(fd)
        dir_fd, name = parent_beneath(str(root), str(path), create=False, mode=0o777)
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(dir_fd)
    except EscapeError as exc:
        raise escaped(exc) from None
    except (FileNotFoundError, NotADirectoryError):  # a missing or non-directory parent: not there
        return None
