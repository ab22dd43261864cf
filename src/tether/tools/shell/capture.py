"""What a sandboxed command changed: listed, held for a person where the policy says so, applied, journaled.

The rules (`change_rules.py`) are the file tools' own (`jail.approval_needed`, `tether.tools.policy.path_rules`):
deleting, moving or overwriting outside the temp directory waits for approval, and so does changing a file that
has another name (a hard link); creating or changing a protected path always does (`protected-path:
<pattern>`), and a change under a hidden path — one the command made by creating it, since an existing
one is masked — is refused and nothing is applied. A held layer is applied when the same command comes
back approved, without running it again, and is judged again then; the approval is bound to exactly the
changes held (`changes_digest`, tools/policy/approval.py).

All the filesystem work (the scan, the hidden and protected rules, the conflict check, the digest, the
journal, the apply, the held note) runs on the sandbox's bounded worker pool (`Sandbox.offload`), never
on the event loop: a command that made 100,000 files does not stall the other sessions. Paths are shown
escaped where they are not UTF-8, so every reply encodes. Only the first `MAX_LISTED` changes are listed
in a reply; all are applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tether.sandbox.layers.diff import layer_diffs
from tether.sandbox.layers.fs import shown
from tether.sandbox.layers.held import Held
from tether.sandbox.layers.layer import (
    Applied,
    ApplyConflict,
    Change,
    LateConflict,
    LayerLimit,
    LayerLimits,
    Record,
    applied_paths,
    apply,
    conflicts,
)
from tether.sandbox.layers.scan import scan
from tether.sandbox.layers.session import SessionLimit, measure
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.policy import approval
from tether.tools.policy.jail import resolve_path
from tether.tools.policy.left_programs import left_programs
from tether.tools.shell.change_rules import MAX_LISTED, guard_hidden, guard_journal, listed_changes, needed_rules
from tether.tools.shell.links import refusal

if TYPE_CHECKING:
    from tether.sandbox.runner import Sandbox

T = TypeVar("T")


def fingerprint(ctx: ToolContext, cmd: str, args: list[str], cwd: str, env: dict[str, str] | None,
                stdin: str | None) -> str:
    """Which held layer an approved re-send of this command takes: the same session, the same command."""
    text = json.dumps([ctx.session_id, cmd, args, cwd, sorted((env or {}).items()), stdin], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _record(ctx: ToolContext) -> Record:
    def record(batch: list[tuple[str, str, str | None, str | None]]) -> None:
        if ctx.journal is not None:
            ctx.journal.record_many(ctx.session_id or "default", batch)
    return record


async def capture(ctx: ToolContext, layer: Path, body: dict[str, Any]) -> list[Change]:
    """The changes the command left in `layer`, scanned on the worker pool. Over the policy's
    `limits`, the layer is dropped and the call fails naming the limit: nothing is applied."""
    sandbox = ctx.sandbox
    assert sandbox is not None
    roots = sandbox.spec.write_roots
    if sandbox.layer_empty(layer):  # most commands write nothing: known from one directory read per root,
        return []  # here on the loop, without the round trip through the worker pool
    limits = getattr(ctx.policy, "limits", None)
    bounds = LayerLimits(getattr(limits, "layer_files", 0), getattr(limits, "layer_bytes", 0))
    try:
        return await _on_pool(sandbox, layer, _scan, layer, roots, sandbox.spec.hidden, sandbox.layer_since(layer),
                              bounds)
    except LayerLimit as exc:
        sandbox.release(layer)
        raise ToolError(f"denied by limit '{exc.rule}': {exc}", {**body, "limit": exc.rule, "applied": False}) from None
    except (OSError, ValueError) as exc:
        sandbox.release(layer)
        raise ToolError(f"reading the command's changes failed ({_said(exc)}); nothing was applied",
                        {**body, "applied": False}) from None


async def _on_pool(sandbox: Sandbox, layer: Path, fn: Callable[..., T], *args: Any,
                   settled: Callable[[asyncio.Future[T]], None] | None = None) -> T:
    """`fn` on the worker pool. If the caller is cancelled meanwhile (its timeout, a CANCEL), the work
    still runs to its end — an apply is never cut half way — and then `settled` (by default: release
    the layer) runs, so a layer is never removed under a worker still reading it."""
    future = sandbox.submit(fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(settled or (lambda _: sandbox.release(layer)))
        raise


def _scan(layer: Path, roots: tuple[str, ...], hidden: tuple[str, ...], since_ns: int,
          limits: LayerLimits) -> list[Change]:
    """What the command changed; whiteouts the warden planted over `hidden` paths are no change, and a
    layer holding only those is empty (`layer_empty`)."""
    from tether.sandbox.runner import layer_empty

    return [] if layer_empty(layer, roots, hidden) else scan(layer, roots, hidden, since_ns=since_ns, limits=limits)


def _apply(ctx: ToolContext, changes: list[Change], others: Applied | None
           ) -> tuple[tuple[list[str], list[str]], dict[int, dict[str, Any]]]:
    """On the worker pool: the guards, each changed text file's diff (read before the apply replaces
    the old content), then the journaled apply; (the paths touched, the diffs by change index)."""
    guard_journal(ctx, changes)
    diffs = _diffs(ctx, changes)
    apply(changes, _record(ctx), others)
    return applied_paths(changes), diffs


def _diffs(ctx: ToolContext, changes: list[Change]) -> dict[int, dict[str, Any]]:
    """The bounded diff of each changed text file the policy lets the caller read (`layers.diff`)."""
    def readable(path: str) -> bool:
        try:
            resolve_path(ctx.policy, path, write=False, hidden=ctx.secrets)
        except (PolicyDenied, OSError, ValueError):
            return False
        return True

    return layer_diffs(changes[:MAX_LISTED], readable)


async def apply_changes(ctx: ToolContext, layer: Path, changes: list[Change],
                        body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Journal and apply on the worker pool; the layer is removed whatever happens. A conflict with
    another session's change applies nothing and names the paths. Errors are tool errors, never half-said.
    Once applied, the programs left in a project's program directories are named in `body["left_programs"]`
    (`tether.tools.policy.left_programs`)."""
    sandbox = ctx.sandbox
    assert sandbox is not None
    limits = getattr(ctx.policy, "limits", None)
    files, written = measure(changes)
    try:  # the session's totals, reserved here on the loop: two of its commands cannot both slip under them
        sandbox.sessions.reserve(ctx.session_id, files, written, getattr(limits, "session_files", 0),
                                 getattr(limits, "session_bytes", 0))
    except SessionLimit as exc:
        sandbox.release(layer)
        raise ToolError(f"denied by limit '{exc.rule}': {exc}",
                        {"changes": listed_changes(changes), "limit": exc.rule, "applied": False}) from None

    def settled(future: asyncio.Future[tuple[tuple[list[str], list[str]], dict[int, dict[str, Any]]]]) -> None:
        if not future.cancelled() and future.exception() is None:  # the caller went away meanwhile
            sandbox.note_applied(*future.result()[0])
        elif _nothing_applied(future.exception() if not future.cancelled() else None):
            sandbox.sessions.refund(ctx.session_id, files, written)
        sandbox.release(layer)

    try:
        touched, diffs = await _on_pool(sandbox, layer, _apply, ctx, changes, sandbox.applied_since(layer),
                                        settled=settled)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if _nothing_applied(exc):  # what was applied in part stays counted
            sandbox.sessions.refund(ctx.session_id, files, written)
        sandbox.release(layer)
        if isinstance(exc, LateConflict):
            raise ToolError(f"applying the command's changes stopped: {exc}; that was kept, and what was applied "
                            "is journaled and can be undone",
                            {"changes": listed_changes(changes),
                             "conflicts": [shown(p) for p in exc.paths[:MAX_LISTED]],
                             "applied": "partly"}) from None
        if isinstance(exc, ApplyConflict):
            raise ToolError(f"nothing was applied: {exc}; run the command again",
                            {"changes": listed_changes(changes),
                             "conflicts": [shown(p) for p in exc.paths[:MAX_LISTED]],
                             "applied": False}) from None
        if isinstance(exc, OSError | ValueError):
            raise ToolError(f"applying the command's changes failed ({_said(exc)}); what was applied is journaled "
                            "and can be undone", {"changes": listed_changes(changes)}) from None
        raise
    sandbox.note_applied(*touched)
    sandbox.release(layer)
    if body is not None and (left := left_programs((c.path, c.kind) for c in changes)):
        body["left_programs"] = [shown(p) for p in left[:MAX_LISTED]]
    return listed_changes(changes, diffs)


def _nothing_applied(exc: BaseException | None) -> bool:
    """Whether an apply that ended with `exc` applied nothing (a conflict found before it began, or a
    journal guard), so its session reservation is given back; None: it was cancelled before it ran."""
    return exc is None or (isinstance(exc, ApplyConflict | PolicyDenied) and not isinstance(exc, LateConflict))


def _said(exc: BaseException) -> str:
    return str(exc).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _judge(ctx: ToolContext, changes: list[Change], others: Applied | None
           ) -> tuple[list[str], list[tuple[Change, str]]]:
    """On the worker pool: a change under a hidden path refused (PolicyDenied), then the conflicts with
    changes made meanwhile, then the rule each change needs (one compiled protected matcher for all)."""
    guard_hidden(ctx, changes)
    clashes = conflicts(changes, others)
    if clashes:
        return clashes, []
    return clashes, needed_rules(ctx, changes)


async def settle(ctx: ToolContext, key: str, layer: Path, changes: list[Change], body: dict[str, Any], preview: str,
                 *, hold_only: bool) -> list[dict[str, Any]]:
    """Apply the changes, or hold them (and raise NeedsApproval) when one needs a person.

    A change another session made meanwhile to a path this command changed is a conflict: nothing is
    applied (nor held), and the error names the paths.
    """
    sandbox = ctx.sandbox
    assert sandbox is not None
    if hold_only:  # a preview: what the command would change, with its diffs, and nothing applied
        diffs: dict[int, dict[str, Any]] = {}
        if changes:  # cancelled meanwhile: `_on_pool` releases the layer once the worker is done with it
            diffs = await _on_pool(sandbox, layer, _diffs, ctx, changes)
        sandbox.release(layer)
        return listed_changes(changes, diffs)
    if not changes:
        sandbox.release(layer, empty=True)
        return []
    try:
        clashes, needs = await _on_pool(sandbox, layer, _judge, ctx, changes, sandbox.applied_since(layer))
    except PolicyDenied:  # a change under a hidden path: refused, nothing applied
        sandbox.release(layer)
        raise
    except (OSError, ValueError) as exc:
        sandbox.release(layer)
        raise ToolError(f"checking the command's changes failed ({_said(exc)}); nothing was applied",
                        {**body, "changes": listed_changes(changes), "applied": False}) from None
    if clashes:
        try:  # cancelled: `_on_pool` releases the layer once the worker is done with it
            why, links = await _on_pool(sandbox, layer, refusal, ctx, changes, clashes)
        except (OSError, ValueError):
            why, links = str(ApplyConflict(clashes)), []
        sandbox.release(layer)
        extra: dict[str, Any] = {"hard_links": links} if links else {}
        again = "" if links and len(links) == len(clashes) else "; run the command again"
        raise ToolError(f"`{preview}` ran in the sandbox and nothing was applied: {why}{again}",
                        {**body, "changes": listed_changes(changes), "applied": False,
                         "conflicts": [shown(p) for p in clashes[:MAX_LISTED]], **extra})
    if needs and not ctx.approved_by:
        def settled(future: asyncio.Future[NeedsApproval]) -> None:  # the caller went away meanwhile
            if future.cancelled() or future.exception() is not None:
                sandbox.release(layer)  # not held: nothing to expire it
            # else a cancelled caller leaves it held (it expires); never released under the worker writing its note

        try:
            question = await _on_pool(sandbox, layer, _hold, ctx, key, Held(layer, changes, body),
                                      f"`{preview}` ran in the sandbox", needs, settled=settled)
        except (OSError, ValueError) as exc:
            sandbox.release(layer)
            raise ToolError(f"holding the command's changes failed ({_said(exc)}); nothing was applied",
                            {**body, "changes": listed_changes(changes), "applied": False}) from None
        raise question
    return await apply_changes(ctx, layer, changes, body)


def _hold(ctx: ToolContext, key: str, held: Held, what: str, needs: list[tuple[Change, str]]) -> NeedsApproval:
    """On the worker pool: the question (its digest reads the new contents), then the layer held."""
    question = _held_question(ctx, what, held.changes, held.payload, needs)
    assert ctx.sandbox is not None
    ctx.sandbox.held.put(key, held)
    return question


def _held_question(ctx: ToolContext, what: str, changes: list[Change], body: dict[str, Any],
                   needs: list[tuple[Change, str]] | None = None) -> NeedsApproval:
    """The question about held changes; `changes_digest` binds its approval to exactly these (with their
    new contents: tools/policy/approval.py), so other changes held later under the same command are asked again.
    Reads files: call it on the worker pool. `needs`: the rules already judged (else judged here)."""
    if needs is None:
        needs = needed_rules(ctx, changes)
    needs = needs or [(c, "approval") for c in changes]
    listed = "; ".join(f"{rule}: {c.kind} {shown(c.path)}" for c, rule in needs[:20])
    diffs = _diffs(ctx, changes)  # what approving would change, shown to the person who approves
    index = {id(c): i for i, c in enumerate(changes)}
    err = NeedsApproval(needs[0][1], f"{what} and nothing was applied: {listed}. Once approved, exactly these "
                                     "changes are applied and the command does not run again")
    err.result.update({**body, "changes": listed_changes(changes, diffs),
                       "changes_digest": approval.changes_digest(changes),
                       "needs_approval_for": [{**c.public(), **diffs.get(index.get(id(c), -1), {}), "rule": rule}
                                              for c, rule in needs[:MAX_LISTED]]})
    return err


_SWAPPED = "the changes held now are not the ones approved; the command ran in the sandbox"


async def claim_held(ctx: ToolContext, key: str) -> ToolContext:
    """For an approval that was not of the command alone (`ctx.approval`): approved when the layer held
    under `key` is the one it approved (the same changes, the same contents); when another is held
    there now, `NeedsApproval` about it (nothing runs or is applied; asked again); else not approved.
    Looked up on the worker pool (it may read notes and the held contents)."""
    if ctx.approval is None or ctx.sandbox is None:
        return ctx
    return await ctx.sandbox.offload(_claim, ctx, key)


def _claim(ctx: ToolContext, key: str) -> ToolContext:
    claim, sandbox = ctx.approval, ctx.sandbox
    assert claim is not None and sandbox is not None
    held = sandbox.held.peek(key)
    if held is None:
        return ctx
    if claim.matches(approval.changes_digest(held.changes)):
        return dataclasses.replace(ctx, approved_by=claim.by)
    raise _held_question(ctx, _SWAPPED, held.changes, held.payload)


async def take_held(ctx: ToolContext, key: str) -> Held | None:
    """The layer held for this approved command, if any, taken on the worker pool (it may read notes);
    when an approval's claim no longer matches what is held (swapped since `claim_held` looked), it is
    left held and `NeedsApproval` asks again, nothing applied."""
    if ctx.sandbox is None or not ctx.approved_by:
        return None
    return await ctx.sandbox.offload(_take, ctx, key)


def _take(ctx: ToolContext, key: str) -> Held | None:
    sandbox, claim = ctx.sandbox, ctx.approval
    assert sandbox is not None
    held = sandbox.held.take(key)
    if held is not None and claim is not None and not claim.matches(approval.changes_digest(held.changes)):
        sandbox.held.put(key, held)  # swapped since `claim_held` looked: asked again, nothing applied
        raise _held_question(ctx, _SWAPPED, held.changes, held.payload)
    return held
