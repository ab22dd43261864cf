"""What a file tool's change must pass before it is made, and the journal entry it writes first.

Approval (`approval.*` rules, hard links), protected and hidden paths inside a tree being deleted or
moved, the device's state directory, and `_apply`: journal-then-change in a worker thread.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from tether.sandbox.layers.fs import EscapeError
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.policy.hidden import HiddenSet, hidden_inside
from tether.tools.policy.jail import approval_needed, escaped, lstat_in, real, within
from tether.tools.policy.path_rules import protected_inside, protected_matcher, require_person, tree_paths


def _spare_journal(ctx: ToolContext, target: Path) -> None:
    """Deleting or moving a directory that holds the state directory would take every undo with it."""
    if ctx.journal is not None and within(real(ctx.journal.root.parent), [target]):
        raise PolicyDenied("journal", f"{str(target)!r} contains the device's state directory "
                                      f"({ctx.journal.root.parent})")


def _require_approval(ctx: ToolContext, action: Literal["delete", "move", "overwrite"], path: Path,
                      what: str) -> None:
    rule = approval_needed(ctx.policy, action, path, ctx.temp_dir)
    if rule and not ctx.approved_by:
        raise NeedsApproval(rule, what)


def _require_one_link(ctx: ToolContext, st: os.stat_result, path: Path) -> None:
    """Writing into a file with other hard links changes it under every name, and one may lie outside
    the roots (or be a file that needs approval): a person decides, even in the temp dir."""
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and not ctx.approved_by:
        raise NeedsApproval("approval.hardlink", f"{str(path)!r} has {st.st_nlink} hard links: writing to it changes "
                                                 "the same file under its other names, which may lie anywhere")


def _journal(ctx: ToolContext, action: Literal["write", "delete", "move", "mkdir"], path: Path,
             dest: Path | None = None) -> bool:
    if ctx.journal is None:
        return False
    try:
        ctx.journal.record(ctx.session_id or "default", action, path, dest)
    except (OSError, ValueError) as exc:
        # Refuse the change rather than make one that cannot be undone.
        raise ToolError(f"could not journal {path} before changing it ({exc}); nothing was changed") from exc
    return True


def _lstat(ctx: ToolContext, path: Path, *, write: bool) -> os.stat_result | None:
    return lstat_in(ctx.policy, path, write=write)


async def _apply(change: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    """Run journal-then-change in a worker thread; an OS refusal (permissions, full disk) is a tool error."""
    try:
        return await asyncio.to_thread(change)
    except EscapeError as exc:
        raise escaped(exc) from None
    except OSError as exc:
        raise ToolError(f"{what} failed: {exc.strerror or exc}"
                        f"{f' ({exc.filename})' if exc.filename else ''}") from None


def _protect(ctx: ToolContext, what: str, *paths: Path) -> None:
    """A protected path among `paths` waits for a person (rule `protected-path: <pattern>`)."""
    require_person(ctx.policy, paths, what, ctx.approved_by)


def _spare_hidden(ctx: ToolContext, target: Path) -> None:
    """Deleting or moving a directory takes everything in it along: never a hidden path."""
    entry = hidden_inside(ctx.policy, target, ctx.secrets)
    if entry is not None:
        raise PolicyDenied("hide_paths", f"{str(target)!r} contains the hidden path {entry!r}: no tool may change "
                                         "anything there")


def _protect_tree(ctx: ToolContext, what: str, src: Path, dst: Path | None = None) -> None:
    """Every entry of a directory being deleted (or moved to `dst`): a protected one asks a person."""
    if ctx.approved_by:
        return
    found = tree_paths(src)
    if found is None:
        raise NeedsApproval("protected-path: (too many entries to check)",
                            f"{what}: {str(src)!r} holds too many entries to check each for a protected path")
    matcher = protected_matcher(ctx.policy)
    for inner in found:
        moved = dst / inner.relative_to(src) if dst is not None else None
        require_person(ctx.policy, [inner] if moved is None else [inner, moved], what, None, matcher)


def _arrive(ctx: ToolContext, src: Path, dst: Path, *, is_dir: bool) -> None:
    """A directory or symlink moved to `dst` decides what is found below `dst`: never a hidden path
    (`mv ~/kit ~/.config` would put `kit/tether` at `~/.config/tether`), and a protected place below
    it, or a protected entry in the moved tree, waits for a person."""
    entry = HiddenSet.of(ctx.policy, ctx.secrets).inside(dst)
    if entry is not None:
        raise PolicyDenied("hide_paths", f"moving {str(src)!r} to {str(dst)!r} would decide what lies at the hidden "
                                         f"path {entry!r}: no tool may create anything there")
    what = f"move of {str(src)!r} to {str(dst)!r}"
    rule = None if ctx.approved_by else protected_inside(ctx.policy, dst)
    if rule is not None:
        raise NeedsApproval(rule, f"{what}: a protected place lies below {str(dst)!r}")
    if is_dir:
        _protect_tree(ctx, what, src, dst)
