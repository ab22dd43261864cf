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
import base64
import codecs
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from tether.sandbox.layers.fs import EscapeError, move_entry, remove_entry
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.files import diffs
from tether.tools.policy.jail import (
    approval_needed,
    escaped,
    lstat_in,
    open_at,
    open_in,
    parent_in,
    real,
    real_all,
    resolve_path,
    within,
)
from tether.tools.policy.path_rules import (
    HiddenSet,
    check_hidden,
    check_hidden_inode,
    hidden_inside,
    protected_inside,
    protected_matcher,
    require_person,
    tree_paths,
)
from tether.tools.runtime import ToolSet, tool

_KIND = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not hang a tool; it is refused after fstat


def _kind(mode: int) -> str:
    return _KIND.get(stat.S_IFMT(mode), "other")


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


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


def _spare_journal(ctx: ToolContext, target: Path) -> None:
    """Deleting or moving a directory that holds the state directory would take every undo with it."""
    if ctx.journal is not None and within(real(ctx.journal.root.parent), [target]):
        raise PolicyDenied("journal", f"{str(target)!r} contains the device's state directory "
                                      f"({ctx.journal.root.parent})")


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


def _pread(fd: int, size: int, offset: int) -> bytes:
    """Up to `size` bytes from `offset`; short reads are only allowed at end of file."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _check_encoding(encoding: str) -> None:
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise ToolError(f"unknown encoding {encoding!r}") from None


def _decode(data: bytes, encoding: str, truncated: bool) -> tuple[str, int, bool]:
    """Text if it decodes (a character cut by truncation is left for the next read), else base64."""
    if b"\x00" not in data:
        try:
            return data.decode(encoding), len(data), False
        except UnicodeDecodeError as exc:
            if truncated and exc.start >= len(data) - 3 and exc.start > 0:
                try:
                    return data[: exc.start].decode(encoding), exc.start, False
                except UnicodeDecodeError:
                    pass
    return base64.b64encode(data).decode("ascii"), len(data), True


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


def _conceals(hidden: HiddenSet, dir_fd: int, directory: Path, name: str) -> bool:
    """A hidden path is left out of its parent's listing, and so is a symlink that leads into one."""
    if hidden.by(directory / name) is not None:
        return True
    try:
        if not stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return False
    except OSError:
        return False
    return hidden.by(real(directory / name)) is not None


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


def _list_entry(dir_fd: int, name: str) -> dict[str, Any] | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        entry: dict[str, Any] = {"name": name, "type": _kind(st.st_mode), "size": st.st_size,
                                 "mtime": _iso(st.st_mtime)}
        if entry["type"] == "symlink":
            entry["target"] = os.readlink(name, dir_fd=dir_fd)
    except OSError:  # removed (or replaced) while we listed
        return None
    return entry


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


def _readlink(ctx: ToolContext, entry: Path) -> str:
    dir_fd, name = parent_in(ctx.policy, entry, write=False)
    try:
        return os.readlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


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
                "journaled": journaled, **(diffs.overwrite_diff(ctx, path, old, data) if old is not None else {})}

    return await _apply(apply, f"writing {file_path}")


def _create(dir_fd: int, name: str, path: Path) -> int:
    try:
        return open_at(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, path, 0o666)
    except FileExistsError:
        raise ToolError(f"already exists: {path} (it appeared while this call ran; look at it and retry)") from None


def _open_existing(ctx: ToolContext, dir_fd: int, name: str, path: Path, *, append: bool) -> int:
    """The file to change, checked again on its fd: what is written is what was judged (no FIFO, no
    new hard link since the check)."""
    fd = open_at(dir_fd, name, os.O_WRONLY | _NONBLOCK | (os.O_APPEND if append else 0), path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ToolError(f"not a regular file: {path} ({_kind(st.st_mode)}); it changed while this call ran")
        _require_one_link(ctx, st, path)
        check_hidden_inode(ctx.policy, st, path, ctx.secrets)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _journal_open(ctx: ToolContext, fd: int, path: Path, *, truncate: bool) -> bool:
    """Journal the original, then truncate: the file is opened (and checked) before anything is saved."""
    try:
        journaled = _journal(ctx, "write", path)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return journaled


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


def _has_entries(ctx: ToolContext, directory: Path) -> bool:
    fd = open_in(ctx.policy, directory, os.O_RDONLY | os.O_DIRECTORY, write=True)
    try:
        return bool(os.listdir(fd))
    finally:
        os.close(fd)


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
                "type": _kind(src_st.st_mode), "journaled": journaled}

    return await _apply(apply, f"moving {source} to {destination}")


def _move(ctx: ToolContext, src: Path, dst: Path) -> None:
    src_fd, src_name = parent_in(ctx.policy, src, write=True)
    try:
        dst_fd, dst_name = parent_in(ctx.policy, dst, write=True)
        try:
            move_entry(src_fd, src_name, dst_fd, dst_name)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def files_toolset() -> ToolSet:
    """A fresh tool set each call (no shared registry)."""
    return ToolSet("files", [read_file, list_dir, file_info, write_file, delete_file, move_file],
                   description="read, list, inspect, write, delete and move files inside the allowed roots")
