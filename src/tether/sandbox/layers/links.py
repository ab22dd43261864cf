"""Hard links a sandboxed command made: a new name (`ln`) for a file the real tree holds.

The overlay copies the file up and links the copy, so the new name looks like an entry copied up whose
real file went away, which `layer.conflicts` refuses. This tells such a name from a real conflict, so
the refusal can say what it is. Everything here blocks on the filesystem (a worker thread's work).
"""

from __future__ import annotations

import os

from tether.sandbox.layers.layer import Change


def hard_links(changes: list[Change], clashes: list[str]) -> dict[str, list[str]]:
    """Which of `clashes` are not conflicts but hard links the command made: a new name (`ln`) for a
    file the real tree holds, which the overlay copied up and linked, so it looks like an entry copied up
    whose real file went away. Maps each such path to the real paths of its other names in the layer
    (empty where none is found there). These are refused all the same: nothing of the layer is applied."""
    wanted = set(clashes)
    found: dict[str, list[str]] = {}
    for c in changes:
        if c.path not in wanted or not (c.copied and c.kind == "created" and c.node == "file" and c.source):
            continue
        try:
            st = os.lstat(c.source)
        except OSError:
            continue
        if st.st_nlink < 2:
            continue
        rel = os.path.relpath(c.path, c.root)
        upper = c.source[: len(c.source) - len(rel)].rstrip("/") or "/"
        others: list[str] = []
        for directory, _dirs, files in os.walk(upper):  # the layer only (bounded by its limits), no link followed
            for name in files:
                full = os.path.join(directory, name)
                if full != c.source and _same_inode(full, st):
                    others.append(os.path.normpath(os.path.join(c.root, os.path.relpath(full, upper))))
        found[c.path] = sorted(others)
    return found


def _same_inode(path: str, st: os.stat_result) -> bool:
    try:
        other = os.lstat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)
