"""What a sandboxed command changed: listed, held for a person where the policy says so, applied, journaled.

The rules are the file tools' own (`jail.approval_needed`): deleting, moving or overwriting outside
the temp directory waits for approval, and so does changing a file that has another name (a hard
link). A held layer is applied when the same command comes back approved, without running it again.
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

_VERBS = {"deleted": "delete", "modified": "overwrite", "renamed": "move"}


def fingerprint(ctx: ToolContext, cmd: str, args: list[str], cwd: str, env: dict[str, str] | None,
                stdin: str | None) -> str:
    """Which held layer an approved re-send of this command takes: the same session, the same command."""
    text = json.dumps([ctx.session_id, cmd, args, cwd, sorted((env or {}).items()), stdin], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def change_rule(ctx: ToolContext, change: Change) -> str | None:
    """The approval rule this change needs, or None."""
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
    return approval_needed(ctx.policy, verb, target, ctx.temp_dir)  # type: ignore[arg-type]


def _guard_journal(ctx: ToolContext, changes: list[Change]) -> None:
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
    needs = [(c, rule) for c in changes if (rule := change_rule(ctx, c))]
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
