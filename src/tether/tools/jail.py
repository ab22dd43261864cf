"""The path jail: every path a tool touches is resolved (symlinks, `..`, `~`) and then checked.

Checking the resolved path, not the string, is what stops `root/../etc` and a symlink that points
out of the allowed roots. A path that does not exist yet is resolved through its nearest existing
parent, so a new file under a symlinked directory is judged by where it would really land.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from tether.tools.errors import PolicyDenied
from tether.tools.policy import Policy


def real(path: str | os.PathLike[str], cwd: str | os.PathLike[str] | None = None) -> Path:
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_absolute():
        p = Path(cwd if cwd is not None else os.getcwd()).expanduser() / p
    return Path(os.path.realpath(p))


def _roots(roots: list[str]) -> list[Path]:
    return [real(r) for r in roots]


def within(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def resolve_path(policy: Policy, path: str, *, write: bool, cwd: str | None = None) -> Path:
    """The real path of `path` if the policy lets a tool read (or write) it; else `PolicyDenied`."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise PolicyDenied("path.invalid", f"not a usable path: {path!r}")
    resolved = real(path, cwd)
    rule, roots = ("write_roots", policy.write_roots) if write else ("read_roots", policy.read_roots)
    if not within(resolved, _roots(roots)):
        raise PolicyDenied(rule, f"{path!r} resolves to {str(resolved)!r}, outside the allowed roots {roots}")
    return resolved


def check_cwd(policy: Policy, cwd: str | None) -> Path:
    """`shell.run` must say where it runs, and that place must lie inside the roots (seed 004)."""
    if not cwd:
        raise PolicyDenied("cwd.required", "cwd is required: give an absolute directory inside the allowed roots")
    resolved = resolve_path(policy, cwd, write=False)
    if not resolved.is_dir():
        raise PolicyDenied("cwd.exists", f"cwd {cwd!r} is not an existing directory")
    return resolved


def approval_needed(policy: Policy, action: Literal["delete", "move", "overwrite"], path: Path,
                    temp_dir: str) -> str | None:
    """The rule that makes this action wait for a person, or None when it may go ahead."""
    rules = policy.approval
    in_temp = within(path, [real(temp_dir)])
    if action == "delete" and rules.delete and not in_temp:
        return "approval.delete"
    if action == "move" and rules.move and not in_temp:
        return "approval.move"
    if action == "overwrite" and rules.overwrite_outside_temp and not in_temp:
        return "approval.overwrite_outside_temp"
    return None
