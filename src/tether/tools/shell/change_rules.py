"""How a sandboxed command's changes are judged before any is applied: the approval rule each needs (the file
tools' own rules: `jail.approval_needed`, `tether.tools.policy.path_rules`), what is refused outright (a change
under a hidden path, or inside the device's state directory), and how a reply lists them (`MAX_LISTED`).
`capture.py` runs them on the sandbox's worker pool."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether.sandbox.layers.fs import shown
from tether.sandbox.layers.layer import Change
from tether.tools.context import ToolContext
from tether.tools.errors import PolicyDenied
from tether.tools.policy.hidden import HiddenSet
from tether.tools.policy.jail import approval_needed, real, within
from tether.tools.policy.path_rules import Matcher, anchored_places, protected_inside, protected_matcher, protected_rule

_VERBS = {"deleted": "delete", "modified": "overwrite", "renamed": "move"}
MAX_LISTED = 1000  # changes listed in a reply (a reply with 100,000 of them would be megabytes)


def made_or_there(changes: list[Change]) -> Callable[[str], bool]:
    """Whether a path exists once `changes` are applied: one of them makes it, or it is on disk."""
    made = {c.path for c in changes if c.kind != "deleted"}
    return lambda path: path in made or os.path.lexists(path)


def change_rule(ctx: ToolContext, change: Change, matcher: Matcher | None = None,
                places: list[tuple[str, str]] | None = None,
                exists: Callable[[str], bool] = os.path.lexists) -> str | None:
    """The approval rule this change needs, or None: a protected path first (created ones too, and a
    symlink or a deleted directory that would change what is found at a protected place below it).
    `exists`: whether a path exists, the command's own new entries counted (`made_or_there`)."""
    matcher = matcher or protected_matcher(ctx.policy)
    for touched in (change.path, change.moved_from):
        rule = protected_rule(ctx.policy, touched, matcher, change.node, exists) if touched else None
        if rule is None and touched and (change.node == "symlink" or change.kind == "deleted"):
            rule = protected_inside(ctx.policy, touched, places if places is not None else
                                    anchored_places(ctx.policy))
        if rule is not None:
            return rule
    verb = _VERBS.get(change.kind)
    if verb is None:
        return None
    target = Path((change.moved_from if change.kind == "renamed" else change.path) or change.path)
    if change.kind == "modified" and change.node == "file":
        try:
            if os.lstat(target).st_nlink > 1:
                return "approval.hardlink"
        except OSError:
            pass
    return approval_needed(ctx.policy, verb, target, ctx.temp_dir, matcher)  # type: ignore[arg-type]


def guard_hidden(ctx: ToolContext, changes: list[Change]) -> None:
    """A change under a hidden path (which the command could only have made by creating the path, e.g.
    `mkdir -p ~/.config/tether`), or a deleted directory holding one: refused, nothing applied."""
    if not changes:
        return  # most commands change nothing: no rule to build
    hidden = HiddenSet.of(ctx.policy, ctx.secrets)
    for c in changes:
        for touched in (c.path, c.moved_from):
            if not touched:
                continue
            entry = hidden.by(touched)
            removed = c.kind == "deleted" or touched == c.moved_from  # its whole tree goes with it
            if entry is None and (removed or c.node == "symlink"):  # a link would redirect what lies below
                entry = hidden.inside(touched)
            if entry is not None:
                err = PolicyDenied("hide_paths", f"the command {c.kind} {shown(touched)}, which lies in (or holds) the "
                                                 f"hidden path {entry!r}; nothing was applied")
                err.result["changes"] = listed_changes(changes)
                raise err


def guard_journal(ctx: ToolContext, changes: list[Change]) -> None:
    """`guard_hidden`, then a change inside the device's state directory (its journal, token, policy): refused,
    nothing applied."""
    guard_hidden(ctx, changes)
    if ctx.journal is None:
        return
    state = real(ctx.journal.root.parent)  # the journal, the token, the policy: see tools.files.tool._resolve
    inside = str(state).rstrip("/") + "/"
    for c in changes:  # string prefixes on normalized absolute paths: 100,000 changes cost milliseconds
        if c.path == str(state) or c.path.startswith(inside) or (
                c.kind == "deleted" and within(state, [Path(c.path)])):
            raise PolicyDenied("journal", f"the command changed {shown(c.path)}, inside the device's state "
                                          "directory; nothing applied")


def needed_rules(ctx: ToolContext, changes: list[Change]) -> list[tuple[Change, str]]:
    """Each change that needs a person's approval, with its rule (`change_rule`, one compiled protected
    matcher for all; the command's own new entries count as existing)."""
    matcher, places, exists = protected_matcher(ctx.policy), anchored_places(ctx.policy), made_or_there(changes)
    return [(c, rule) for c in changes if (rule := change_rule(ctx, c, matcher, places, exists))]


def listed_changes(changes: list[Change], diffs: dict[int, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The changes as a reply lists them (the first `MAX_LISTED`), each with its diff record where
    `diffs` has one (`layers.diff.text_diff`: `diff`, `added`, `removed`, or `diff_skipped`)."""
    listed = [{**c.public(), **(diffs or {}).get(i, {})} for i, c in enumerate(changes[:MAX_LISTED])]
    if len(changes) > MAX_LISTED:
        listed.append({"omitted": len(changes) - MAX_LISTED, "total": len(changes)})
    return listed
