"""Built-in file tools: read, list, inspect, write, delete, move — jailed, approved and journaled.

Every path goes through the realpath jail first (hidden paths refused there, existing or not, and
left out of listings), and is then opened beneath the root it lies in
with no symlink followed (`jail.open_in`), so a link swapped in after the check is refused. A
change to an existing file outside the temp directory, or to a file with more than one hard link,
waits for a person's approval (policy `approval.*`), creating or changing a protected path always
does (`tether.tools.policy.path_rules`), and whatever a tool is about to change is
copied into the undo journal before it is changed. The mutating bodies run in a worker thread as
one unit (journal, then change): copying a large original must not stall the event loop,
and a timeout can only lose the reply, never leave a change without its journal entry.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any, Literal

from tether.sandbox.layers.fs import remove_entry
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.files import diffs
from tether.tools.files.entries import (
    _NONBLOCK,
    _check_encoding,
    _conceals,
    _create,
    _decode,
    _has_entries,
    _iso,
    _journal_open,
    _kind,
    _list_entry,
    _move,
    _open_existing,
    _pread,
    _readlink,
)
from tether.tools.files.guards import (
    _apply,
    _arrive,
    _journal,
    _lstat,
    _protect,
    _protect_tree,
    _require_approval,
    _require_one_link,
    _spare_hidden,
    _spare_journal,
)
from tether.tools.policy.hidden import HiddenSet, check_hidden, check_hidden_inode
from tether.tools.policy.jail import open_in, parent_in, real, real_all, resolve_path, within
from tether.tools.policy.left_programs import program_place
from tether.tools.runtime import ToolSet, tool


def _resolve(ctx: ToolContext, path: str, *, write: bool, hidden: HiddenSet | None = None) -> Path:
    """`jail.resolve_path`, and the device's state directory is off limits, to read as to write: it
    holds the undo journal (a tool that could edit it could make a later undo write anything
    anywhere), the device token and pairing key (a tool that could read them would hand the
    device's identity to whoever asked), and the server's policy changes (editing them would grant
    the next start whatever the file says). The sandbox hides the same directory from processes.

    The policy's hidden paths and the device's own secrets (`ctx.secrets`) are refused here too (rule
    `hide_paths`), existing or not: no file tool reads, lists or creates anything there. `hidden`: the
    call's own look at them (`HiddenSet.of`), when it took one already.

    A path below the temp dir leads into the session's private /tmp where the sandbox gives it one, as
    the session's commands see it (`Sandbox.map_tmp`); another session's private /tmp is refused (rule
    `private_tmp`), however it is named (its real path, a link)."""
    sandbox = ctx.sandbox
    shown = path
    if sandbox is not None:
        path = sandbox.map_tmp(ctx.session_id, path)
    resolved = resolve_path(ctx.policy, path, write=write, hidden=ctx.secrets, hidden_set=hidden)
    if sandbox is not None and sandbox.foreign_tmp(ctx.session_id, str(resolved)):
        raise PolicyDenied("private_tmp", f"{shown!r} lies in another session's private /tmp")
    if ctx.journal is not None and within(resolved, real_all(ctx.policy, (str(ctx.journal.root.parent),))):
        raise PolicyDenied("journal", f"{path!r} lies inside the device's state directory "
                                      f"({ctx.journal.root.parent}: its undo journal, token and policy)")
    return resolved


def _entry_path(ctx: ToolContext, path: str, *, write: bool) -> Path:
    """The path itself when its last component is a symlink (delete/move/inspect the link, not its target).

    The target is jail-checked too (`_resolve`), so a link is always judged by where it points.
    """
    hidden = HiddenSet.of(ctx.policy, ctx.secrets)  # one look at the hidden paths for the whole check
    resolved = _resolve(ctx, path, write=write, hidden=hidden)
    if ctx.sandbox is not None:
        path = ctx.sandbox.map_tmp(ctx.session_id, path)
    raw = Path(os.path.expanduser(path))
    if raw.name in ("", ".", ".."):
        return resolved
    candidate = real(raw.parent) / raw.name
    check_hidden(ctx.policy, candidate, ctx.secrets, shown=path, kept=hidden)
    if not candidate.is_symlink():
        return resolved
    try:
        _resolve(ctx, str(candidate.parent), write=write, hidden=hidden)
    except PolicyDenied:
        return resolved
    return candidate


# ------------------------------------------------------------------------------------------ reading


@tool(tool_type="data_collection")
async def read_file(ctx: ToolContext, file_path: str, encoding: str = "utf-8", max_bytes: int = 1048576,
                    offset: int = 0) -> dict[str, Any]:
    """Read a file's text (or base64 for binary data), from `offset`, at most `max_bytes` bytes.

    Results travel over the wire, so reads are capped by the policy's `max_output_bytes` too;
    `next_offset` says where to continue a truncated read.
    """
    if max_bytes <= 0 or offset < 0:
        raise ToolError("max_bytes must be > 0 and offset >= 0")
    _check_encoding(encoding)
    path = _resolve(ctx, file_path, write=False)
    limit = min(max_bytes, ctx.policy.max_output_bytes)
    try:
        fd = open_in(ctx.policy, path, os.O_RDONLY | _NONBLOCK, write=False)
    except (FileNotFoundError, NotADirectoryError):
        raise ToolError(f"not found: {file_path}") from None
    except IsADirectoryError:
        raise ToolError(f"is a directory: {file_path} (use list_dir)") from None
    except PermissionError:
        raise ToolError(f"permission denied: {file_path}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ToolError(f"is a directory: {file_path} (use list_dir)")
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"not a regular file: {file_path} ({_kind(st.st_mode)})")
        check_hidden_inode(ctx.policy, st, path, ctx.secrets)
        data = _pread(fd, limit + 1, offset)
    finally:
        os.close(fd)
    truncated = len(data) > limit
    data = data[:limit]
    content, used, binary = _decode(data, encoding, truncated)
    result: dict[str, Any] = {
        "path": str(path), "content": content, "encoding": "base64" if binary else encoding,
        "size": st.st_size, "truncated": truncated, "binary": binary, "offset": offset, "bytes_read": used,
    }
    if truncated:
        result["next_offset"] = offset + used
    return result


@tool(tool_type="data_collection")
async def list_dir(ctx: ToolContext, path: str, show_hidden: bool = False, limit: int = 1000) -> dict[str, Any]:
    """List a directory's entries sorted by name; hidden entries only when asked, to keep replies short."""
    if limit <= 0:
        raise ToolError("limit must be > 0")
    hidden = HiddenSet.of(ctx.policy, ctx.secrets)  # one look at the hidden paths: the path and its entries
    directory = _resolve(ctx, path, write=False, hidden=hidden)
    try:
        fd = open_in(ctx.policy, directory, os.O_RDONLY | os.O_DIRECTORY, write=False)
    except FileNotFoundError:
        raise ToolError(f"not found: {path}") from None
    except NotADirectoryError:
        raise ToolError(f"not a directory: {path} (use read_file or file_info)") from None
    except PermissionError:
        raise ToolError(f"permission denied: {path}") from None
    try:
        names = sorted(n for n in os.listdir(fd) if (show_hidden or not n.startswith("."))
                       and not _conceals(hidden, fd, directory, n))
        entries = [e for e in (_list_entry(fd, name) for name in names[:limit]) if e is not None]
    finally:
        os.close(fd)
    return {"path": str(directory), "entries": entries, "count": len(entries), "total": len(names),
            "truncated": len(names) > limit}


@tool(tool_type="data_collection")
async def file_info(ctx: ToolContext, path: str) -> dict[str, Any]:
    """Describe a path without reading it; a missing path is an answer (`exists: false`), not an error."""
    entry = _entry_path(ctx, path, write=False)
    link = _lstat(ctx, entry, write=False)
    is_symlink = link is not None and stat.S_ISLNK(link.st_mode)
    st = link
    info: dict[str, Any] = {"path": str(entry), "is_symlink": is_symlink}
    if is_symlink:
        info["target"] = _readlink(ctx, entry)
        resolved = _resolve(ctx, str(entry), write=False)
        info["resolved"] = str(resolved)
        st = _lstat(ctx, resolved, write=False)  # resolved: no link left in it, so this is the target
    info["exists"] = st is not None
    if st is None:
        info["type"] = "symlink" if is_symlink else None
        return info
    info.update(type=_kind(st.st_mode), size=st.st_size, mode=f"{stat.S_IMODE(st.st_mode):04o}",
                permissions=stat.filemode(st.st_mode), mtime=_iso(st.st_mtime), owner_uid=st.st_uid,
                group_gid=st.st_gid)
    return info


# ------------------------------------------------------------------------------------------ changing


@tool(tool_type="action")
async def write_file(ctx: ToolContext, file_path: str, content: str,
                     mode: Literal["create", "overwrite", "append"] = "create", encoding: str = "utf-8",
                     create_parents: bool = False) -> dict[str, Any]:
    """Write text to a file. `create` never clobbers; changing an existing file outside the temp dir
    needs approval, and the original is journaled first so it can be put back."""
    _check_encoding(encoding)
    try:
        data = content.encode(encoding)
    except UnicodeEncodeError as exc:
        raise ToolError(f"content cannot be encoded as {encoding}: {exc}") from None
    path = _resolve(ctx, file_path, write=True)
    st = _lstat(ctx, path, write=True)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ToolError(f"is a directory: {file_path}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ToolError(f"not a regular file: {file_path} ({_kind(st.st_mode)})")
    if st is not None and mode == "create":
        raise ToolError(f"already exists: {file_path} (use mode 'overwrite' or 'append' to change it)")
    missing_parents = _missing_parents(path)
    _protect(ctx, f"{mode} of {str(path)!r}", path, *missing_parents)
    if st is not None:
        check_hidden_inode(ctx.policy, st, path, ctx.secrets)
        try:
            _require_approval(ctx, "overwrite", path, f"{mode} of existing file {str(path)!r} outside the temp dir")
            _require_one_link(ctx, st, path)
        except NeedsApproval as held:  # the person is shown what the overwrite would change
            if mode == "overwrite":
                held.result["would_change"] = [await asyncio.to_thread(diffs.would_change, ctx, path, data)]
            raise
    if missing_parents and not create_parents:
        raise ToolError(f"parent directory does not exist: {path.parent} (pass create_parents=true)")

    def apply() -> dict[str, Any]:
        journaled, old = True, None
        for parent in missing_parents:
            journaled = _journal(ctx, "mkdir", parent) and journaled
        try:
            dir_fd, name = parent_in(ctx.policy, path, write=True, create=bool(missing_parents))
        except NotADirectoryError:
            raise ToolError(f"a parent of {file_path} is not a directory") from None
        try:
            if st is None:
                journaled = _journal(ctx, "write", path) and journaled
                fd = _create(dir_fd, name, path)
            else:
                fd = _open_existing(ctx, dir_fd, name, path, append=mode == "append")
                if mode == "overwrite":  # read before the truncation: the result shows before and after
                    old = diffs.read_open(fd)
                journaled = _journal_open(ctx, fd, path, truncate=mode == "overwrite") and journaled
        finally:
            os.close(dir_fd)
        with open(fd, "wb") as fh:
            fh.write(data)
        return {"path": str(path), "bytes_written": len(data), "mode": mode, "created": st is None,
                "journaled": journaled, **(diffs.overwrite_diff(ctx, path, old, data) if old is not None else {}),
                **({"left_programs": [str(path)]} if program_place(str(path)) else {})}

    return await _apply(apply, f"writing {file_path}")


def _missing_parents(path: Path) -> list[Path]:
    """Missing ancestors, outermost first; an existing non-directory ancestor is an error."""
    missing: list[Path] = []
    for parent in path.parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise ToolError(f"not a directory: {parent}")
            break
        missing.append(parent)
    return list(reversed(missing))


@tool(tool_type="action")
async def delete_file(ctx: ToolContext, path: str, recursive: bool = False) -> dict[str, Any]:
    """Delete a file, symlink (the link, not its target) or directory (`recursive` for a non-empty one).

    Deleting outside the temp dir needs approval; the original (a whole tree for a directory) is
    journaled first.
    """
    target = _entry_path(ctx, path, write=True)
    st = _lstat(ctx, target, write=True)
    if st is None:
        raise ToolError(f"not found: {path}")
    is_dir = stat.S_ISDIR(st.st_mode)
    _spare_journal(ctx, target)
    _spare_hidden(ctx, target)
    _protect(ctx, f"delete of {str(target)!r}", target)
    if is_dir and any(real(r) == target for r in ctx.policy.write_roots):
        raise PolicyDenied("write_roots", f"{str(target)!r} is an allowed root itself and cannot be deleted")
    if is_dir and not recursive and _has_entries(ctx, target):
        raise ToolError(f"directory not empty: {path} (pass recursive=true to delete it and its contents)")
    if is_dir:
        await asyncio.to_thread(_protect_tree, ctx, f"delete of {str(target)!r}", target)  # a walk: off the loop
    _require_approval(ctx, "delete", target, f"delete of {str(target)!r} outside the temp dir")

    def apply() -> dict[str, Any]:
        journaled = _journal(ctx, "delete", target)
        dir_fd, name = parent_in(ctx.policy, target, write=True)
        try:
            remove_entry(dir_fd, name)  # by name in its directory: a link is removed, never followed
        finally:
            os.close(dir_fd)
        return {"path": str(target), "deleted": True, "type": _kind(st.st_mode), "journaled": journaled}

    return await _apply(apply, f"deleting {path}")


@tool(tool_type="action")
async def move_file(ctx: ToolContext, source: str, destination: str, overwrite: bool = False) -> dict[str, Any]:
    """Move or rename a file or directory to the full `destination` path.

    Moving something out of a place outside the temp dir needs approval, and so does replacing an
    existing destination; a replaced destination is journaled first so undo brings it back too.
    """
    src = _entry_path(ctx, source, write=True)
    src_st = _lstat(ctx, src, write=True)
    if src_st is None:
        raise ToolError(f"not found: {source}")
    _spare_journal(ctx, src)
    dst = _entry_path(ctx, destination, write=True)
    if dst == src:
        raise ToolError(f"source and destination are the same file: {src}")
    if stat.S_ISDIR(src_st.st_mode) and dst.is_relative_to(src):
        raise ToolError(f"cannot move directory {src} into itself ({dst})")
    if not dst.parent.is_dir():
        raise ToolError(f"destination directory does not exist: {dst.parent}")
    _spare_hidden(ctx, src)
    _protect(ctx, f"move of {str(src)!r} to {str(dst)!r}", src, dst)
    if stat.S_ISDIR(src_st.st_mode) or stat.S_ISLNK(src_st.st_mode):
        await asyncio.to_thread(_arrive, ctx, src, dst, is_dir=stat.S_ISDIR(src_st.st_mode))  # a walk: off the loop
    dst_st = _lstat(ctx, dst, write=True)
    if dst_st is not None:
        if not overwrite:
            raise ToolError(f"destination exists: {destination} (pass overwrite=true to replace it)")
        if stat.S_ISDIR(dst_st.st_mode):
            raise ToolError(f"destination is a directory: {destination}; give the full target path "
                            "(a directory is never replaced by a move)")
        if stat.S_ISDIR(src_st.st_mode):
            raise ToolError(f"cannot replace file {destination} with directory {source}")
    _require_approval(ctx, "move", src, f"move of {str(src)!r} (outside the temp dir) to {str(dst)!r}")
    if dst_st is not None:
        _require_approval(ctx, "overwrite", dst, f"move would replace {str(dst)!r} outside the temp dir")

    def apply() -> dict[str, Any]:
        journaled = True
        if dst_st is not None:
            journaled = _journal(ctx, "delete", dst)
        journaled = _journal(ctx, "move", src, dst) and journaled
        _move(ctx, src, dst)  # a rename replaces a symlink at dst; it never writes through it
        return {"source": str(src), "destination": str(dst), "replaced": dst_st is not None,
                "type": _kind(src_st.st_mode), "journaled": journaled,
                **({"left_programs": [str(dst)]} if program_place(str(dst)) else {})}

    return await _apply(apply, f"moving {source} to {destination}")


def files_toolset() -> ToolSet:
    """A fresh tool set each call (no shared registry)."""
    return ToolSet("files", [read_file, list_dir, file_info, write_file, delete_file, move_file],
                   description="read, list, inspect, write, delete and move files inside the allowed roots")
