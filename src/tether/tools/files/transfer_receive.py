"""The receiving half of a file transfer between devices: check, take chunks into a partial file, verify, commit.

Everything is written under this device's rules, as `write_file` writes: each destination is jail-checked
(write roots, hidden paths, the state directory), must be where its lexical path says (a symlink planted in
the destination tree is refused, never followed), a protected path or an existing file outside the temp
directory waits for a person (`NeedsApproval`: the server's approval flow), and everything changed is
journaled first, so undoing the session puts the destination back.

A file arrives in a partial file beside it, `.tether-part-<transfer id>-<index>`, which survives a restart
of this device: `transfer_begin` reports how much of each file is there, and the sender goes on from that
offset. Only `transfer_commit` makes a file visible under its name: after the partial's sha256 matched the
sender's (a mismatch removes the partial and fails), by a rename in the same directory.
"""

from __future__ import annotations

import binascii
import os
import posixpath
import re
import stat
from pathlib import Path
from typing import Any, Literal

from tether.tools.context import ToolContext
from tether.tools.errors import PolicyDenied, ToolError
from tether.tools.files.guards import _apply, _journal, _require_approval, _require_one_link
from tether.tools.files.tool import _missing_parents, _resolve
from tether.tools.files.transfer_send import sha256_fd
from tether.tools.policy.hidden import check_hidden, check_hidden_inode
from tether.tools.policy.jail import lstat_in, open_at, parent_in, real
from tether.tools.policy.left_programs import program_place
from tether.tools.policy.path_rules import require_person
from tether.tools.runtime import tool

_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
_SHA = re.compile(r"[0-9a-f]{64}")
PART_PREFIX = ".tether-part-"
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def _check_id(transfer_id: str) -> None:
    if not _ID.fullmatch(transfer_id):
        raise ToolError(f"bad transfer id {transfer_id!r}: 8-64 letters, digits, '_' or '-'")


def check_rel(rel: str) -> str:
    """A relative entry path as the sender wrote it, refused (ToolError) when it could leave the tree:
    absolute, with an empty, '.' or '..' component, or a NUL byte. "" is the root itself (a file sent)."""
    if rel == "":
        return rel
    parts = rel.split("/")
    if "\x00" in rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or len(rel) > 4096:
        raise ToolError(f"refused entry name {rel!r}: entries are relative paths without '', '.' or '..' parts")
    return rel


def _target(ctx: ToolContext, root: str, rel: str) -> Path:
    """The checked destination of entry `rel` below `root`: where its name says, nowhere else."""
    lexical = real(root) / check_rel(rel) if rel else real(root)
    resolved = _resolve(ctx, str(lexical), write=True)
    if resolved != lexical:
        raise PolicyDenied("path.escape", f"{str(lexical)!r} leads to {str(resolved)!r} (a symlink in the "
                                          "destination): a transfer writes only where its names say")
    return resolved


def _part(target: Path, transfer_id: str, index: int) -> Path:
    return target.parent / f"{PART_PREFIX}{transfer_id}-{index}"


def _size_of(ctx: ToolContext, path: Path) -> int:
    st = lstat_in(ctx.policy, path, write=True)
    return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else 0


def _same_file(ctx: ToolContext, path: Path, size: int, sha256: str) -> bool:
    """Whether `path` already holds exactly these bytes (a commit that happened before a reconnect)."""
    st = lstat_in(ctx.policy, path, write=True)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return sha256_fd(fd, size) == sha256
    finally:
        os.close(fd)


def _check_entry(entry: Any, kind: str) -> dict[str, Any]:
    if not isinstance(entry, dict) or entry.get("type") not in ("file", "dir", "symlink"):
        raise ToolError(f"bad manifest entry {entry!r}: needs a type file, dir or symlink")
    rel = entry.get("path")
    if not isinstance(rel, str) or (rel == "" and (kind != "file" or entry["type"] != "file")):
        raise ToolError(f"bad manifest entry path {rel!r}")
    check_rel(rel)
    if entry["type"] == "file":
        size, sha = entry.get("size"), entry.get("sha256")
        if not isinstance(size, int) or size < 0 or not isinstance(sha, str) or not _SHA.fullmatch(sha):
            raise ToolError(f"manifest entry {rel!r} needs a size and a sha256")
    if entry["type"] == "symlink":
        link = entry.get("target")
        lands = posixpath.normpath(posixpath.join(posixpath.dirname(rel), link)) if isinstance(link, str) else "/"
        if not isinstance(link, str) or link.startswith("/") or lands == ".." or lands.startswith("../") \
                or "\x00" in link:
            raise ToolError(f"refused symlink {rel!r} -> {link!r}: a link must stay inside the tree sent")
    return entry


def _link_place(ctx: ToolContext, root: str, rel: str) -> Path:
    """Where a symlink entry goes: its directory checked as `_target` checks, the name itself not followed."""
    parent = _target(ctx, root, posixpath.dirname(rel))
    place = parent / posixpath.basename(rel)
    check_hidden(ctx.policy, place, ctx.secrets, shown=str(place))
    return place


def _judge(ctx: ToolContext, root: str, entry: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """What receiving `entry` means here; raises when the policy refuses it or a person must decide."""
    kind = entry["type"]
    target = _link_place(ctx, root, entry["path"]) if kind == "symlink" else _target(ctx, root, entry["path"])
    require_person(ctx.policy, [target], f"transfer into {str(target)!r}", ctx.approved_by)
    st = lstat_in(ctx.policy, target, write=True)
    if st is not None and kind == "symlink" and stat.S_ISLNK(st.st_mode) and os.readlink(target) == entry["target"]:
        return {"target": target, "exists": True, "done": True}  # made before a reconnect
    if st is not None and kind == "dir":
        if not stat.S_ISDIR(st.st_mode):
            raise ToolError(f"{str(target)!r} exists and is not a directory")
        return {"target": target, "exists": True}
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{str(target)!r} is a directory; a {kind} cannot replace it")
    if st is not None and kind == "file" and _same_file(ctx, target, entry["size"], entry["sha256"]):
        return {"target": target, "exists": True, "done": True}  # committed before a reconnect: nothing to send
    if st is not None and not overwrite:
        raise ToolError(f"already exists: {str(target)!r} (pass overwrite to replace it)", {"exists": str(target)})
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"{str(target)!r} is not a regular file; a transfer does not replace it")
        check_hidden_inode(ctx.policy, st, target, ctx.secrets)
        _require_approval(ctx, "overwrite", target, f"transfer would replace {str(target)!r} outside the temp dir")
        _require_one_link(ctx, st, target)
    return {"target": target, "exists": st is not None}


@tool(tool_type="action", meta=True)
async def transfer_begin(ctx: ToolContext, transfer_id: str, dest: str, kind: Literal["file", "dir"],
                         name: str, entries: list[dict[str, Any]], overwrite: bool = False,
                         into: bool = True) -> dict[str, Any]:
    """Check a whole incoming transfer against this device's policy, make its directories, and say how much
    of each file is here already (to resume from).

    `dest`: where it goes; with `into`, an existing directory there receives it as `dest/name` (as `cp`
    does). `entries`: the sender's manifest. Returns `{"root", "files": [{"index", "have", "done"}]}`
    (`index`: the entry's position in `entries`). Errors: refused by policy, needs approval, an existing
    file without `overwrite`.
    """
    _check_id(transfer_id)
    checked = [_check_entry(e, kind) for e in entries]
    if kind == "file" and len(checked) != 1:
        raise ToolError("a file transfer has exactly one entry")
    base = _resolve(ctx, dest, write=True)

    def apply() -> dict[str, Any]:  # in a worker thread: judging may hash files already there
        root = base
        if into and os.path.isdir(root):
            if not name or "/" in name or name in (".", ".."):
                raise ToolError(f"bad name {name!r} for an entry inside {dest}")
            root = root / name
        root_path = str(root)
        _target(ctx, root_path, "")  # the root itself: where its name says, inside the write roots, not hidden
        judged = [_judge(ctx, root_path, e, overwrite) for e in checked]
        missing = _missing_parents(root if kind == "file" else root / "x")
        require_person(ctx.policy, missing, f"transfer into {root_path!r}", ctx.approved_by)
        journaled = True
        for parent in missing:
            journaled = _journal(ctx, "mkdir", parent) and journaled
        if missing:
            fd, _ = parent_in(ctx.policy, root if kind == "file" else root / "x", write=True, create=True)
            os.close(fd)
        files = []
        for index, (entry, verdict) in enumerate(zip(checked, judged, strict=True)):
            if entry["type"] == "dir" and not verdict["exists"]:
                journaled = _journal(ctx, "mkdir", verdict["target"]) and journaled
                fd, name_ = parent_in(ctx.policy, verdict["target"], write=True)
                try:
                    os.mkdir(name_, 0o700 | (entry.get("mode", 0o755) & 0o755), dir_fd=fd)
                except FileExistsError:
                    pass
                finally:
                    os.close(fd)
            elif entry["type"] == "file":
                part = _part(verdict["target"], transfer_id, index)
                done = bool(verdict.get("done"))
                files.append({"index": index, "have": entry["size"] if done else _size_of(ctx, part), "done": done})
        return {"root": root_path, "files": files, "journaled": journaled}

    return await _apply(apply, f"preparing {dest}")


@tool(tool_type="action", meta=True)
async def write_file_chunk(ctx: ToolContext, transfer_id: str, root: str, path: str, index: int, offset: int,
                           size: int, data: str) -> dict[str, Any]:
    """Write one chunk (base64 `data`) of entry `path` at `offset` into its partial file (never the file
    itself: `transfer_commit` verifies and renames). `size` is the file's whole size; a chunk past it is
    refused. Returns `{"have"}`: how many bytes the partial holds. An `offset` past what the partial holds
    fails with the result `{"have": N}`, from which the sender goes on.

    The first chunk (offset 0) creates the partial file after every check `transfer_begin` makes (write
    roots, hidden and protected paths, no symlink on the way) and journals it. A later chunk only appends to
    that partial: opened beneath its write root with no symlink followed, and refused unless it is there
    already as a regular file with one link, so it can only be the file the first chunk created.
    """
    _check_id(transfer_id)
    try:
        chunk = binascii.a2b_base64(data, strict_mode=True)  # in C; b64decode(validate=True) checks with a regex
    except (binascii.Error, ValueError):
        raise ToolError("the chunk is not valid base64") from None
    if offset < 0 or index < 0 or offset + len(chunk) > size:
        raise ToolError(f"chunk at {offset} (+{len(chunk)} bytes) lies outside the file's {size} bytes")
    if offset == 0:
        target = _target(ctx, root, path)
        require_person(ctx.policy, [target], f"transfer into {str(target)!r}", ctx.approved_by)
        part = _part(target, transfer_id, index)
        _resolve(ctx, str(part), write=True)
    else:
        lexical = real(root) / check_rel(path) if path else real(root)
        part = _part(lexical, transfer_id, index)

    def apply() -> dict[str, Any]:
        dir_fd, name = parent_in(ctx.policy, part, write=True)
        try:
            if offset == 0:
                st = lstat_in(ctx.policy, part, write=True)
                if st is None:
                    _journal(ctx, "write", part)  # undo removes a partial a transfer left behind
                    fd = open_at(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, part)
                else:
                    fd = open_at(dir_fd, name, os.O_WRONLY, part)
            else:
                try:
                    fd = open_at(dir_fd, name, os.O_WRONLY | _NONBLOCK, part)
                except FileNotFoundError:
                    raise ToolError(f"no partial file for {path!r}: start at offset 0", {"have": 0}) from None
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise ToolError(f"the partial file of {path!r} is not a regular file with one link; refused")
            have = st.st_size
            if offset > have:
                raise ToolError(f"the partial file of {path!r} holds {have} bytes, not {offset}", {"have": have})
            if have > offset:
                os.ftruncate(fd, offset)  # a chunk sent again after a reconnect
            os.pwrite(fd, chunk, offset)
        finally:
            os.close(fd)
        return {"have": offset + len(chunk)}

    return await _apply(apply, f"writing a chunk of {path or root}")


@tool(tool_type="action", meta=True)
async def transfer_commit(ctx: ToolContext, transfer_id: str, root: str, path: str, index: int,
                          type: Literal["file", "symlink"], size: int = 0, sha256: str = "", mode: int = 0o644,
                          target: str = "", overwrite: bool = False) -> dict[str, Any]:
    """Make one received entry visible: a file once its partial holds `size` bytes whose sha256 is `sha256`
    (a mismatch removes the partial and fails with `checksum_mismatch`), renamed over its name after the
    name's present content is journaled; a symlink to the relative `target`. Returns `{"path", "bytes",
    "sha256", "journaled"}`, and `left_programs` naming it when it lies in a project's venv `bin/` or
    `node_modules/.bin` (`tether.tools.policy.left_programs`).
    """
    _check_id(transfer_id)
    entry = _check_entry({"path": path, "type": type, "size": size, "sha256": sha256, "target": target},
                         "file" if path == "" else "dir")

    def apply() -> dict[str, Any]:  # in a worker thread: judging and verifying read whole files
        verdict = _judge(ctx, root, entry, overwrite)
        dest: Path = verdict["target"]
        if verdict.get("done"):
            return {"path": str(dest), "bytes": size, "sha256": sha256, "journaled": False, "already": True}
        part = _part(dest, transfer_id, index)
        dir_fd, name = parent_in(ctx.policy, dest, write=True)
        try:
            if type == "symlink":
                journaled = _journal(ctx, "write", dest)
                os.symlink(target, name, dir_fd=dir_fd)
                return {"path": str(dest), "bytes": 0, "sha256": None, "journaled": journaled}
            part_name = part.name
            if size == 0 and lstat_in(ctx.policy, part, write=True) is None:  # an empty file has no chunks
                _journal(ctx, "write", part)
                os.close(open_at(dir_fd, part_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, part))
            try:
                fd = open_at(dir_fd, part_name, os.O_RDWR, part)
            except FileNotFoundError:
                raise ToolError(f"nothing received for {path or dest.name!r} (no partial file)",
                                {"have": 0}) from None
            try:
                have = os.fstat(fd).st_size
                if have != size:
                    raise ToolError(f"{path or dest.name!r}: {have} of {size} bytes received", {"have": have})
                os.fsync(fd)
                got = sha256_fd(fd, size)
                if got != sha256:
                    os.unlink(part_name, dir_fd=dir_fd)
                    raise ToolError(f"checksum mismatch for {path or dest.name!r}: the sender's sha256 is {sha256}, "
                                    f"what arrived has {got}; the partial file was removed and nothing was written",
                                    {"checksum_mismatch": True, "expected": sha256, "got": got, "have": 0})
                os.fchmod(fd, mode & 0o777)
            finally:
                os.close(fd)
            journaled = _journal(ctx, "write", dest)
            os.rename(part_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return {"path": str(dest), "bytes": size, "sha256": sha256, "journaled": journaled}
        finally:
            os.close(dir_fd)

    done = await _apply(apply, f"committing {path or root}")  # a program left in a project's venv or node_modules
    return {**done, "left_programs": [done["path"]]} if not done.get("already") and program_place(done["path"]) \
        else done
