"""The undo journal: a copy of every file a tool is about to change, so a session can be put back.

Layout: `state_dir/journal/<session_id>/entries.jsonl` (append-only; one JSON object a line) and
`blobs/` (the saved originals). An entry line describes one change; an `undone` line marks an entry
as put back. Nothing is ever rewritten in place, so a crash leaves at worst a torn last line, which
is skipped; and a restore that stops half way can simply be run again.

A restore puts things back through the same jail as the file tools (`tether.sandbox.layers.fs`): beneath
the write root each path lies in, with no symlink followed on the way. Whoever could write inside
the roots since the change may have planted a link in the path; that change is then reported as a
conflict and left as is, never written through the link to somewhere outside the roots.

Saved copies keep holes as holes (`filedata.copy_data`: a reflink where the filesystem has them, else only
the stretches that hold data), so journaling a 1-byte append to a 2 GiB sparse file costs a block,
not 2 GiB; their checksum (`digest`, "zsha256:...") is taken over the non-zero 4 KiB blocks and
their offsets, so it costs what the data costs, not what the size says. An append to a file of at
least `GROWN_MIN` bytes (the new content given to `record_many` starts with the whole old content)
keeps no copy at all: a "grown" entry with the old size and a checksum of the added bytes, undone by
cutting the file back once those bytes are found still there. Paths not UTF-8 are kept as
`os.fsdecode` gives them (the index's JSON escapes them) and shown escaped in a restore's report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from tether.sandbox.layers.fs import EscapeError, shown
from tether.tools.journal.copies import _copy_synced, _copy_tree, _grown
from tether.tools.journal.restore import (
    _cut_back,
    _jail_of,
    _jails,
    _move_back,
    _outside,
    _put_dir_back,
    _put_file_back,
    _put_link_back,
    _remove_created,
)

try:  # POSIX only; elsewhere concurrent restores of one session are not serialised.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

Action = Literal["write", "delete", "move", "mkdir"]
_ACTIONS: frozenset[str] = frozenset({"write", "delete", "move", "mkdir"})
_SESSION_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,127}")
_INDEX = "entries.jsonl"


def validate_session_id(session_id: str) -> str:
    """Session ids become directory names, so anything that could climb out of the journal is refused."""
    if (not isinstance(session_id, str) or ".." in session_id
            or not _SESSION_RE.fullmatch(session_id)):
        raise ValueError(
            f"invalid session id {session_id!r}: use 1-128 letters, digits and . _ @ + = - "
            "(no path separators, no '..', not starting with '.' or '-')")
    return session_id


class UndoJournal:
    """Saves originals before tools change them and puts them back, newest first, on `restore`."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir).expanduser() / "journal"

    # ----------------------------------------------------------------------------------- recording

    def record(self, session_id: str, action: Action, path: Path | str,
               dest: Path | str | None = None) -> dict[str, Any]:
        """Save what `path` is now, before `action` changes it; returns the index entry written.

        `write` of a missing path records a "created" entry (undo deletes the file); `mkdir`
        records a directory the tool is about to create (undo removes it if it is empty again).
        """
        session_dir = self._created_session_dir(session_id)
        entry = self._entry(session_dir, action, path, dest)
        self._append(session_dir, entry)
        return entry

    def record_many(self, session_id: str, changes: list[tuple[Any, ...]]) -> int:
        """`record` for a whole batch before any of it is made, with one index write and one fsync;
        returns how many entries were written. Each change is (action, path, dest) or (action, path,
        dest, new): `new`, for a "write", names the file that will replace `path`, so an append is
        journaled as the old size only.

        A sandboxed command that created a thousand files would otherwise pay a thousand fsyncs. An
        entry journaled for a change that a crash then kept from happening undoes to the same state
        (a "created" path that is absent, an original put back over itself), so writing them all first
        is as safe as one at a time. Each entry becomes its line at once (no 100,000 dicts kept alive
        for the garbage collector to walk while the batch is written).
        """
        if not changes:
            return 0
        session_dir = self._created_session_dir(session_id)
        lines = [_line(self._entry(session_dir, *change)) for change in changes]
        self._write_lines(session_dir, "".join(lines).encode())
        return len(lines)

    def _entry(self, session_dir: Path, action: Action, path: Path | str, dest: Path | str | None,
               new: str | None = None) -> dict[str, Any]:
        if action not in _ACTIONS:
            raise ValueError(f"unknown journal action {action!r}: expected one of {sorted(_ACTIONS)}")
        target = os.path.abspath(path)
        # uuid4's hex, at a fraction of uuid.uuid4()'s cost: a batch journals thousands of these
        entry: dict[str, Any] = {"id": os.urandom(16).hex(), "ts": time.time(), "action": action, "path": target}
        if action == "move":
            if dest is None:
                raise ValueError("a move needs its destination")
            if not os.path.lexists(target):
                raise FileNotFoundError(f"cannot journal a move of {target}: it does not exist")
            entry.update(kind="moved", dest=os.path.abspath(dest))
        elif action == "mkdir" or not os.path.lexists(target):
            if action == "delete":
                raise FileNotFoundError(f"cannot journal a delete of {target}: it does not exist")
            entry["kind"] = "created"
        else:
            grown = _grown(target, new) if action == "write" and new else None
            entry.update(grown or self._save(session_dir, entry["id"], Path(target), action))
        return entry

    def _save(self, session_dir: Path, entry_id: str, target: Path, action: str) -> dict[str, Any]:
        st = target.lstat()
        meta: dict[str, Any] = {"mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns}
        if stat.S_ISLNK(st.st_mode):
            return {**meta, "kind": "symlink", "link": os.readlink(target)}
        blobs = session_dir / "blobs"
        blobs.mkdir(mode=0o700, exist_ok=True)
        if stat.S_ISDIR(st.st_mode):
            if action != "delete":
                raise IsADirectoryError(f"cannot journal a {action} of directory {target}")
            _copy_tree(target, blobs, entry_id)  # no link followed, holes kept
            return {**meta, "kind": "dir", "blob": entry_id}
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"cannot journal {shown(str(target))}: not a regular file, directory or symlink")
        digest, size = _copy_synced(target, blobs / entry_id)
        return {**meta, "kind": "file", "blob": entry_id, "size": size, "digest": digest}

    def _append(self, session_dir: Path, *records: dict[str, Any]) -> None:
        """One `write` of whole lines with O_APPEND, then fsync: a reader sees each whole line or none.

        After a torn last line (a crash mid-append) a newline is written first, so the new record
        is not glued onto the fragment and lost with it.
        """
        self._write_lines(session_dir, "".join(_line(r) for r in records).encode())

    def _write_lines(self, session_dir: Path, line: bytes) -> None:
        fd = os.open(session_dir / _INDEX, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    # ----------------------------------------------------------------------------------- reading

    def entries(self, session_id: str) -> list[dict[str, Any]]:
        """The session's change entries, oldest first, each with `undone` (its undo outcome or None)."""
        session_dir = self._session_dir(session_id)
        if session_dir is None:
            return []
        changes: list[dict[str, Any]] = []
        undone: dict[str, dict[str, Any]] = {}
        for rec in _read_index(session_dir / _INDEX):
            if "undone" in rec:
                undone[rec["undone"]] = rec
            elif "id" in rec:
                changes.append(rec)
        return [{**e, "undone": undone.get(e["id"])} for e in changes]

    def sessions(self) -> list[dict[str, Any]]:
        """Every journaled session with how many changes it holds, how many are still undoable, and when."""
        if not self.root.is_dir():
            return []
        rows = []
        for child in sorted(self.root.iterdir()):
            if not (child / _INDEX).is_file() or not _SESSION_RE.fullmatch(child.name):
                continue
            entries = self.entries(child.name)
            if not entries:
                continue
            pending = sum(1 for e in entries if e["undone"] is None)
            rows.append({"session_id": child.name, "entries": len(entries), "pending": pending,
                         "restored": len(entries) - pending,
                         "first_at": _iso(entries[0]["ts"]), "last_at": _iso(entries[-1]["ts"])})
        return rows

    # ----------------------------------------------------------------------------------- restoring

    def restore(self, session_id: str, roots: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Undo the session's changes newest first; one report row per change, in the order tried.

        Each undone change is marked in the index as soon as it is put back, so running this again
        touches nothing and reports every row as `already_restored`. A change that could not be put
        back (say, a conflict) stays pending and is retried next time.

        `roots` (the policy's write roots): a change is put back only beneath the root its path lies
        in; one outside every root is refused. None: beneath `/`. Either way no symlink is followed,
        so a link planted in the path since the change makes it a conflict, not a write elsewhere.
        """
        session_dir = self._session_dir(session_id)
        if session_dir is None:
            return []
        jails = _jails(roots)
        report: list[dict[str, Any]] = []
        with _locked(session_dir):
            for entry in reversed(self.entries(session_id)):
                row = {"id": entry["id"], "action": entry["action"], "path": shown(entry["path"])}
                if entry.get("dest"):
                    row["dest"] = shown(entry["dest"])
                if entry["undone"] is not None:
                    report.append({**row, "outcome": "already_restored", "ok": True})
                    continue
                try:
                    outcome, ok = self._undo(session_dir, entry, jails)
                except EscapeError as exc:
                    outcome, ok = f"conflict: {_said(exc)}; left as is (the path changed after the write)", False
                except OSError as exc:
                    outcome, ok = f"failed: {type(exc).__name__}: {_said(exc)}", False
                if ok:
                    self._append(session_dir, {"undone": entry["id"], "ts": time.time(), "outcome": outcome})
                report.append({**row, "outcome": outcome, "ok": ok})
        return report

    def _undo(self, session_dir: Path, entry: dict[str, Any], jails: list[str]) -> tuple[str, bool]:
        path = entry["path"]
        root = _jail_of(path, jails)
        if root is None:
            return _outside(path, jails)
        kind = entry.get("kind")
        if kind == "created":
            return _remove_created(root, path)
        if kind == "moved":
            dest_root = _jail_of(entry["dest"], jails)
            if dest_root is None:
                return _outside(entry["dest"], jails)
            return _move_back(root, path, dest_root, entry["dest"])
        if kind == "symlink":
            return _put_link_back(root, path, entry["link"])
        if kind == "grown":
            return _cut_back(root, path, entry)
        blob = session_dir / "blobs" / entry["blob"]
        if not os.path.lexists(blob):
            return f"failed: saved copy {blob} is missing", False
        if kind == "dir":
            return _put_dir_back(blob, root, path, entry["mode"])
        return _put_file_back(blob, root, path, entry)

    # ----------------------------------------------------------------------------------- helpers

    def _session_dir(self, session_id: str) -> Path | None:
        path = self.root / validate_session_id(session_id)
        return path if path.is_dir() else None

    def _created_session_dir(self, session_id: str) -> Path:
        path = self.root / validate_session_id(session_id)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)
        return path


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def _said(exc: BaseException) -> str:
    return shown(str(exc).encode("utf-8", "surrogateescape"))


def _read_index(index: Path) -> Iterator[dict[str, Any]]:
    """Every intact line; a torn line (crash mid-append) is skipped rather than failing the restore."""
    try:
        data = index.read_bytes()
    except FileNotFoundError:
        return
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


@contextlib.contextmanager
def _locked(session_dir: Path) -> Iterator[None]:
    """Two restores of one session at once must not both put the same change back."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(session_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
