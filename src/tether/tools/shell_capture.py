"""What a sandboxed command changed: listed, held for a person where the policy says so, applied, journaled.

The rules are the file tools' own (`jail.approval_needed`, `tether.tools.path_rules`): deleting,
moving or overwriting outside the temp directory waits for approval, and so does changing a file that
has another name (a hard link); creating or changing a protected path always does (`protected-path:
<pattern>`), and a change under a hidden path — one the command made by creating it, since an existing
one is masked — is refused and nothing is applied. A held layer is applied when the same command comes
back approved, without running it again, and is judged again then.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tether.sandbox.held import Held
from tether.sandbox.layer import ApplyConflict, Change, apply
from tether.tools import approval
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.jail import approval_needed, real, within
from tether.tools.path_rules import (
    HiddenSet,
    Matcher,
    anchored_places,
    protected_inside,
    protected_matcher,
    protected_rule,
)

_VERBS = {"deleted": "delete", "modified": "overwrite", "renamed": "move"}


def fingerprint(ctx: ToolContext, cmd: str, args: list[str], cwd: str, env: dict[str, str] | None,
                stdin: str | None) -> str:
    """Which held layer an approved re-send of this command takes: the same session, the same command."""
    text = json.dumps([ctx.session_id, cmd, args, cwd, sorted((env or {}).items()), stdin], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def change_rule(ctx: ToolContext, change: Change, matcher: Matcher | None = None,
                places: list[tuple[str, str]] | None = None) -> str | None:
    """The approval rule this change needs, or None: a protected path first (created ones too, and a
    symlink or a deleted directory that would change what is found at a protected place below it)."""
    matcher = matcher or protected_matcher(ctx.policy)
    for touched in (change.path, change.moved_from):
        rule = protected_rule(ctx.policy, touched, matcher) if touched else None
        if rule is None and touched and (change.node == "symlink" or change.kind == "deleted"):
            rule = protected_inside(ctx.policy, touched, places if places is not None else
                                    anchored_places(ctx.policy))
        if rule is not None:
            return rule
    verb = _VERBS.get(change.kind)
    if verb is None:
        return None
    target = Path(change.moved_from if change.kind == "renamed" else change.path)
    if change.kind == "modified" and change.node == "file":
        try:
            if os.lstat(target).st_nlink > 1:
                return "approval.hardlink"
        except OSError:
            pass
    return approval_needed(ctx.policy, verb, target, ctx.temp_dir, matcher)  # type: ignore[arg-type]


def _guard_hidden(ctx: ToolContext, changes: list[Change]) -> None:
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
                err = PolicyDenied("hide_paths", f"the command {c.kind} {touched}, which lies in (or holds) the "
                                                 f"hidden path {entry!r}; nothing was applied")
                err.result["changes"] = _public(changes)
                raise err


def _guard_journal(ctx: ToolContext, changes: list[Change]) -> None:
    _guard_hidden(ctx, changes)
    if ctx.journal is None:
        return
    state = real(ctx.journal.root.parent)  # the journal, the token, the policy: see files._resolve
    for c in changes:
        if within(Path(c.path), [state]) or (c.kind == "deleted" and within(state, [Path(c.path)])):
            raise PolicyDenied("journal", f"the command changed {c.path}, inside the device's state directory; "
                                          "nothing applied")


def _record(ctx: ToolContext):  # type: ignore[no-untyped-def]
    def record(batch: list[tuple[str, str, str | None]]) -> None:
        if ctx.journal is not None:
            ctx.journal.record_many(ctx.session_id or "default", batch)  # type: ignore[arg-type]
    return record


def apply_changes(ctx: ToolContext, layer: Path, changes: list[Change]) -> list[dict[str, Any]]:
    """Journal and apply; the layer is removed whatever happens. Errors are tool errors, never half-said."""
    try:
        _guard_journal(ctx, changes)
        apply(changes, _record(ctx))
    except ApplyConflict as exc:
        raise ToolError(f"nothing was applied: {exc}; run the command again", {"changes": _public(changes)}) from None
    except (OSError, ValueError) as exc:
        raise ToolError(f"applying the command's changes failed ({exc}); what was applied is journaled and "
                        f"can be undone", {"changes": _public(changes)}) from None
    finally:
        if ctx.sandbox is not None:
            ctx.sandbox.release(layer)
    return _public(changes)


def _public(changes: list[Change]) -> list[dict[str, Any]]:
    return [c.public() for c in changes]


def settle(ctx: ToolContext, key: str, layer: Path, changes: list[Change], body: dict[str, Any], preview: str,
           *, hold_only: bool) -> list[dict[str, Any]]:
    """Apply the changes, or hold them (and raise NeedsApproval) when one needs a person."""
    sandbox = ctx.sandbox
    assert sandbox is not None
    if hold_only:
        sandbox.release(layer)
        return _public(changes)
    try:
        _guard_hidden(ctx, changes)
    except PolicyDenied:
        sandbox.release(layer)
        raise
    needs: list[tuple[Change, str]] = []
    if changes:
        matcher, places = protected_matcher(ctx.policy), anchored_places(ctx.policy)
        needs = [(c, rule) for c in changes if (rule := change_rule(ctx, c, matcher, places))]
    if needs and not ctx.approved_by:
        sandbox.held.put(key, Held(layer, changes, body))
        raise _held_question(ctx, f"`{preview}` ran in the sandbox", changes, body)
    return apply_changes(ctx, layer, changes)


def _held_question(ctx: ToolContext, what: str, changes: list[Change], body: dict[str, Any]) -> NeedsApproval:
    """The question about held changes; `changes_digest` binds its approval to exactly these (with their
    new contents: tools/approval.py), so other changes held later under the same command are asked again."""
    needs = [(c, rule) for c in changes if (rule := change_rule(ctx, c))] or [(c, "approval") for c in changes]
    listed = "; ".join(f"{rule}: {c.kind} {c.path}" for c, rule in needs[:20])
    err = NeedsApproval(needs[0][1], f"{what} and nothing was applied: {listed}. Once approved, exactly these "
                                     "changes are applied and the command does not run again")
    err.result.update({**body, "changes": _public(changes), "changes_digest": approval.changes_digest(changes),
                       "needs_approval_for": [{**c.public(), "rule": rule} for c, rule in needs]})
    return err


def claim_held(ctx: ToolContext, key: str) -> ToolContext:
    """For an approval that was not of the command alone (`ctx.approval`): approved when the layer held
    under `key` is the one it approved (the same changes, the same contents); when another is held
    there now, `NeedsApproval` about it (nothing runs or is applied; asked again); else not approved."""
    claim = ctx.approval
    if claim is None or ctx.sandbox is None:
        return ctx
    held = ctx.sandbox.held.peek(key)
    if held is None:
        return ctx
    if claim.matches(approval.changes_digest(held.changes)):
        return dataclasses.replace(ctx, approved_by=claim.by)
    raise _held_question(ctx, "the changes held now are not the ones approved; the command ran in the sandbox",
                         held.changes, held.payload)


def take_held(ctx: ToolContext, key: str) -> Held | None:
    if ctx.sandbox is None or not ctx.approved_by:
        return None
    held = ctx.sandbox.held.take(key)
    claim = ctx.approval
    if held is not None and claim is not None and not claim.matches(approval.changes_digest(held.changes)):
        ctx.sandbox.held.put(key, held)  # swapped since `claim_held` looked: asked again, nothing applied
        raise _held_question(ctx, "the changes held now are not the ones approved; the command ran in the sandbox",
                             held.changes, held.payload)
    return held
