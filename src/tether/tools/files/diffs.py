"""The diff of a file the file tools overwrite: what `write_file` replaces, shown before and after.

A bounded unified diff (`tether.sandbox.layers.diff`: text files of at most 1 MiB, 64 KiB of diff)
of the file's old content against the new, in the tool's result (`diff`, `added`, `removed`, or
`diff_skipped`) and, while the overwrite waits for approval, in the question's `would_change`
entry, so a person approves what they see. Old content the policy does not let the caller read is
described, never shown.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tether.sandbox.layers.diff import MAX_FILE, Budget, read_side, text_diff
from tether.sandbox.layers.fs import shown
from tether.tools.context import ToolContext
from tether.tools.errors import PolicyDenied
from tether.tools.policy.jail import resolve_path


def readable(ctx: ToolContext, path: Path) -> bool:
    """Whether the policy lets the caller read `path` (its old content may be shown)."""
    try:
        resolve_path(ctx.policy, str(path), write=False, hidden=ctx.secrets)
    except (PolicyDenied, OSError, ValueError):
        return False
    return True


def read_open(fd: int) -> bytes | str:
    """The content of the file open (for writing) on `fd`, read through a second, read-only open of the
    same inode; or why not (`layers.diff.read_side`)."""
    return read_side(f"/proc/self/fd/{fd}", (os.fstat(fd).st_ino,), MAX_FILE, follow=True)


def overwrite_diff(ctx: ToolContext, path: Path, old: bytes | str, new: bytes) -> dict[str, Any]:
    """The diff record of overwriting `path` (`old`: its content, or why it was not read) with `new`."""
    if not readable(ctx, path):
        return {"diff_skipped": "not readable under the policy"}
    return text_diff(old, new if len(new) <= MAX_FILE else f"over {MAX_FILE >> 20} MiB", str(path), Budget())


def would_change(ctx: ToolContext, path: Path, new: bytes) -> dict[str, Any]:
    """What an overwrite waiting for approval would do to `path`, as a change record with its diff
    (blocking: reads the file; run it on a worker thread)."""
    old = read_side(str(path)) if readable(ctx, path) else "not readable under the policy"
    return {"path": shown(str(path)), "kind": "modified", "bytes": len(new),
            **overwrite_diff(ctx, path, old, new)}
