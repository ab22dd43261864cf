"""Bounded unified diffs of changed text files: what a person sees before approving, and after.

`text_diff` compares two versions of one file (bytes, or None for "absent"): UTF-8 text without NUL
bytes, each side at most `MAX_FILE` bytes, gives a unified diff (difflib, 3 lines of context) cut at
`Budget.per_file` bytes; anything else is described (`diff_skipped`), never diffed. `layer_diffs` does
that for a captured layer's changes (the real tree's file before, the layer's after), spending one
`Budget` per command. The result is an optional part of a change's public record:

    {"diff": "--- a/p\\n+++ b/p\\n@@ ...", "added": 3, "removed": 1, "diff_truncated": true}
    {"diff_skipped": "binary"}

Files are read without following a link, and a real-tree file is read only while it is still the
file the scan saw (`Change.was`: inode, size, times); paths in the headers are shown escaped
(`fs.shown`). Blocking: call it on a worker thread.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tether.sandbox.layers.fs import shown
from tether.sandbox.layers.layer import Change

MAX_FILE = 1 << 20  # a side larger than this is described, never diffed
PER_FILE = 64 << 10  # diff text kept per file
PER_COMMAND = 256 << 10  # diff text kept per command (or per file tool call)
_NO_EOL = "\\ No newline at end of file\n"
_CONTEXT = 3
_HUNK = re.compile(r"([-+])(\d+)")  # a start line in a hunk header: "@@ -12,3 +12,4 @@"
_LEAST = 1 << 10  # a command's budget with less left than this shows no more diffs (not a header alone)


@dataclass(slots=True)
class Budget:
    """What one command's diffs may still take (bytes of diff text), and the cap of each file's."""

    left: int = PER_COMMAND
    per_file: int = PER_FILE


def read_side(path: str, expect: tuple[int, ...] | None = None, limit: int = MAX_FILE, *, follow: bool = False
              ) -> bytes | str:
    """The content of the regular file `path` (no link followed unless `follow`: a `/proc/self/fd` link),
    or why it is not diffed: "over 1 MiB", "not a regular file", "changed meanwhile" (its (inode, size,
    mtime_ns, ctime_ns) no longer starting with `expect`), "unreadable"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError:
        return "unreadable"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if expect is not None and (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)[:len(expect)] != expect:
            return "changed meanwhile"
        if st.st_size > limit:
            return _over(limit)
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
        return data if len(data) <= limit else _over(limit)  # grown since the fstat
    except OSError:
        return "unreadable"
    finally:
        os.close(fd)


def _over(limit: int) -> str:
    return f"over {limit >> 20} MiB" if limit >= 1 << 20 and not limit % (1 << 20) else f"over {limit} bytes"


def _text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def text_diff(old: bytes | str | None, new: bytes | str | None, path: str, budget: Budget) -> dict[str, Any]:
    """The diff record of one file: `old`/`new` are its bytes (None: absent, as for a created or deleted
    file; a str: the reason that side was not read). Returns `{"diff", "added", "removed"}` (with
    `"diff_truncated": True` when cut at the budget), or `{"diff_skipped": reason}`; never raises."""
    for side in (old, new):
        if isinstance(side, str):
            return {"diff_skipped": side}
    texts: list[str] = []
    for side in (old, new):
        if side is None:
            texts.append("")
            continue
        assert isinstance(side, bytes)
        if b"\x00" in side:
            return {"diff_skipped": "binary"}
        text = _text(side)
        if text is None:
            return {"diff_skipped": "not UTF-8"}
        texts.append(text)
    if budget.left < _LEAST:
        return {"diff_skipped": f"the diffs of this change already hold {PER_COMMAND >> 10} KiB"}
    name = shown(path).lstrip("/")
    before, after = ("/dev/null" if old is None else f"a/{name}"), ("/dev/null" if new is None else f"b/{name}")
    lines = _unified(texts[0].splitlines(keepends=True), texts[1].splitlines(keepends=True), before, after)
    cap = min(budget.per_file, budget.left)
    out: list[str] = []
    size, added, removed, cut = 0, 0, 0, False
    for line in lines:
        if line.startswith("+") and not line.startswith("+++ "):
            added += 1
        elif line.startswith("-") and not line.startswith("--- "):
            removed += 1
        if not line.endswith("\n"):
            line += "\n" + _NO_EOL
        if cut:
            continue
        encoded = len(line.encode("utf-8"))
        if size + encoded > cap:
            cut = True
            continue
        out.append(line)
        size += encoded
    budget.left -= size
    record: dict[str, Any] = {"diff": "".join(out), "added": added, "removed": removed}
    if cut:
        record["diff_truncated"] = True
    return record


def _unified(a: list[str], b: list[str], before: str, after: str) -> Iterator[str]:
    """`difflib.unified_diff(a, b)` with 3 lines of context, the same lines, but the common head and tail
    left out of the comparison first (a one-line edit to a 20,000-line file costs a scan, not difflib's
    matching of every line); the hunk headers' line numbers are moved back by what was left out."""
    import difflib  # only where a file is diffed: a device that never diffs never loads it

    n = min(len(a), len(b))
    head = 0
    while head < n and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < n - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    skip, cut = max(0, head - _CONTEXT), max(0, tail - _CONTEXT)
    for line in difflib.unified_diff(a[skip:len(a) - cut], b[skip:len(b) - cut], before, after, n=_CONTEXT):
        if skip and line.startswith("@@ "):
            line = _HUNK.sub(lambda m: f"{m[1]}{int(m[2]) + skip}", line)
        yield line


def layer_diffs(changes: list[Change], readable: Callable[[str], bool] | None = None,
                budget: Budget | None = None) -> dict[int, dict[str, Any]]:
    """The diff record of each changed regular file, by its index in `changes`: a modified file (the real
    tree's content against the layer's), a created one (all added) and a deleted one (all removed);
    modified files first, so a command's edits are shown before what it created or removed. A path
    `readable` refuses (the policy does not let the caller read it) is described, not shown."""
    budget = budget or Budget()
    out: dict[int, dict[str, Any]] = {}
    order = {"modified": 0, "created": 1, "deleted": 2}
    picked = sorted((i for i, c in enumerate(changes) if c.node == "file" and c.kind in order),
                    key=lambda i: order[changes[i].kind])
    for i in picked:
        c = changes[i]
        if readable is not None and not readable(c.path):
            out[i] = {"diff_skipped": "not readable under the policy"}
            continue
        old: bytes | str | None = None if c.kind == "created" else read_side(c.path, c.was)
        new: bytes | str | None = None
        if c.kind != "deleted":
            new = read_side(c.source) if c.source else "unreadable"
        out[i] = text_diff(old, new, c.path, budget)
    return out
