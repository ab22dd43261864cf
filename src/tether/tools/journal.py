"""The undo journal: a copy of every file a tool is about to change, so a session can be put back.

Layout: `state_dir/journal/<session_id>/entries.jsonl` (append-only; one JSON object a line) and
`blobs/` (the saved originals). An entry line describes one change; an `undone` line marks an entry
as put back. Nothing is ever rewritten in place, so a crash leaves at worst a torn last line, which
is skipped; and a restore that stops half way can simply be run again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

try:  # POSIX only; elsewhere concurrent restores of one session are not serialised.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

Action = Literal["write", "delete", "move", "mkdir"]
_ACTIONS: frozenset[str] = frozenset({"write", "delete", "move", "mkdir"})
_SESSION_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,127}")
_INDEX = "entries.jsonl"
_CHUNK = 1 << 20


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
        if action not in _ACTIONS:
            raise ValueError(f"unknown journal action {action!r}: expected one of {sorted(_ACTIONS)}")
        session_dir = self._session_dir(session_id, create=True)
        target = Path(os.path.abspath(path))
        entry: dict[str, Any] = {"id": uuid.uuid4().hex, "ts": time.time(), "action": action,
                                 "path": str(target)}
        if action == "move":
            if dest is None:
                raise ValueError("a move needs its destination")
            if not os.path.lexists(target):
                raise FileNotFoundError(f"cannot journal a move of {target}: it does not exist")
            entry.update(kind="moved", dest=str(Path(os.path.abspath(dest))))
        elif action == "mkdir" or not os.path.lexists(target):
            if action == "delete":
                raise FileNotFoundError(f"cannot journal a delete of {target}: it does not exist")
            entry["kind"] = "created"
        else:
            entry.update(self._save(session_dir, entry["id"], target, action))
        self._append(session_dir, entry)
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
            shutil.copytree(target, blobs / entry_id, symlinks=True)
            return {**meta, "kind": "dir", "blob": entry_id}
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"cannot journal {target}: not a regular file, directory or symlink")
        digest, size = _copy_synced(target, blobs / entry_id)
        return {**meta, "kind": "file", "blob": entry_id, "size": size, "sha256": digest}

    def _append(self, session_dir: Path, record: dict[str, Any]) -> None:
        """One `write` of one line with O_APPEND, then fsync: a reader sees the whole line or none.

        After a torn last line (a crash mid-append) a newline is written first, so the new record
        is not glued onto the fragment and lost with it.
        """
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
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

    def restore(self, session_id: str) -> list[dict[str, Any]]:
        """Undo the session's changes newest first; one report row per change, in the order tried.

        Each undone change is marked in the index as soon as it is put back, so running this again
        touches nothing and reports every row as `already_restored`. A change that could not be put
        back (say, a conflict) stays pending and is retried next time.
        """
        session_dir = self._session_dir(session_id)
        if session_dir is None:
            return []
        report: list[dict[str, Any]] = []
        with _locked(session_dir):
            for entry in reversed(self.entries(session_id)):
                row = {"id": entry["id"], "action": entry["action"], "path": entry["path"]}
                if entry.get("dest"):
                    row["dest"] = entry["dest"]
                if entry["undone"] is not None:
                    report.append({**row, "outcome": "already_restored", "ok": True})
                    continue
                try:
                    outcome, ok = self._undo(session_dir, entry)
                except OSError as exc:
                    outcome, ok = f"failed: {type(exc).__name__}: {exc}", False
                if ok:
                    self._append(session_dir, {"undone": entry["id"], "ts": time.time(), "outcome": outcome})
                report.append({**row, "outcome": outcome, "ok": ok})
        return report

    def _undo(self, session_dir: Path, entry: dict[str, Any]) -> tuple[str, bool]:
        path = Path(entry["path"])
        kind = entry.get("kind")
        if kind == "created":
            return _remove_created(path)
        if kind == "moved":
            return _move_back(path, Path(entry["dest"]))
        if kind == "symlink":
            if os.path.lexists(path) and not path.is_symlink() and path.is_dir():
                return "conflict: a directory now stands where the symlink was", False
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".tether-undo-{uuid.uuid4().hex}"
            os.symlink(entry["link"], tmp)
            os.replace(tmp, path)
            return "restored", True
        blob = session_dir / "blobs" / entry["blob"]
        if not os.path.lexists(blob):
            return f"failed: saved copy {blob} is missing", False
        if kind == "dir":
            if os.path.lexists(path) and not (path.is_dir() and not path.is_symlink()):
                return "conflict: something other than a directory now stands there", False
            shutil.copytree(blob, path, symlinks=True, dirs_exist_ok=True)
            os.chmod(path, entry["mode"])
            return "restored", True
        if path.is_dir() and not path.is_symlink():
            return "conflict: a directory now stands where the file was", False
        return _put_file_back(blob, path, entry)

    # ----------------------------------------------------------------------------------- helpers

    def _session_dir(self, session_id: str, *, create: bool = False) -> Path | None:
        path = self.root / validate_session_id(session_id)
        if create:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
            return path
        return path if path.is_dir() else None


def _copy_synced(src: Path, dst: Path) -> tuple[str, int]:
    """Copy, hash and fsync in one pass: a journal entry must never point at a half-written copy."""
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return digest.hexdigest(), size


def _put_file_back(blob: Path, path: Path, entry: dict[str, Any]) -> tuple[str, bool]:
    """Write the saved bytes beside the target and rename over it, so a reader never sees a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".tether-undo-", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with open(blob, "rb") as fin, open(fd, "wb") as fout:
            while chunk := fin.read(_CHUNK):
                digest.update(chunk)
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        if digest.hexdigest() != entry["sha256"]:
            tmp.unlink()
            return "failed: the saved copy is corrupt (checksum mismatch); file left as is", False
        os.chmod(tmp, entry["mode"])
        os.utime(tmp, ns=(entry["mtime_ns"], entry["mtime_ns"]))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return "restored", True


def _remove_created(path: Path) -> tuple[str, bool]:
    if not os.path.lexists(path):
        return "already_absent", True
    if path.is_dir() and not path.is_symlink():
        try:
            path.rmdir()
        except OSError:
            return "kept: the directory is not empty", False
        return "removed", True
    path.unlink()
    return "removed", True


def _move_back(source: Path, dest: Path) -> tuple[str, bool]:
    if not os.path.lexists(dest):
        if os.path.lexists(source):
            return "moved_back", True  # a previous restore got this far before stopping
        return f"failed: {dest} no longer exists", False
    if os.path.lexists(source):
        return f"conflict: {source} exists again; {dest} left in place", False
    source.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(dest, source)
    return "moved_back", True


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
