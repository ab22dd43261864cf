"""What the device's sandbox keeps across a restart, in its state directory: a person's `always` egress grants
and the sessions' totals.

- `egress-grants.json`: each `always` a person answered to `ask: on-miss` (the exact `host:port` entry, the
  question's id, the call and session it came from, when), so the entry is back in the device's network
  allow list after a restart. The question id is the one the server's audit records with the person who
  answered it: the file says what was granted, the server's audit who granted it. Removing an entry from
  the file (the device stopped) withdraws it.
- `session-totals.json`: what each session's sandboxed commands applied (`SessionTotals`), so a session
  cannot start afresh by restarting the device.

Both files are mode 0600 in the device's state directory (hidden from every tool and sandboxed command),
written to a temporary file and renamed, so a crash leaves the old or the new one. A file that cannot be
read or parsed is set aside as `<name>.bad` with a warning, never half-used.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GRANTS = "egress-grants.json"
TOTALS = "session-totals.json"
MAX_FILE_BYTES = 8 << 20
MAX_GRANTS = 10_000


def _read(path: Path) -> dict[str, Any] | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("%s: cannot read it (%s): starting without it", path, exc.strerror or exc)
        return None
    try:
        if len(raw) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a version 1 file")
        return data
    except ValueError as exc:
        logger.warning("%s: unusable (%s): set aside as %s.bad, starting without it", path, exc, path.name)
        os.replace(path, path.with_name(path.name + ".bad"))
        return None


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


class Kept:
    """The device's kept sandbox state under `state_dir`; every method does blocking file I/O (call it off
    the event loop where that matters)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir)

    def grants(self) -> list[dict[str, Any]]:
        """The `always` grants kept, oldest first: dicts with at least `entry` (`host:port`)."""
        data = _read(self.dir / GRANTS) or {}
        grants = data.get("grants", [])
        return [g for g in grants if isinstance(g, dict) and isinstance(g.get("entry"), str)] \
            if isinstance(grants, list) else []

    def add_grant(self, entry: str, *, question: str | None, call: str | None, session: str | None) -> None:
        """Keep a person's `always` for `entry` (once: an entry already kept is not added again)."""
        grants = self.grants()
        if any(g["entry"] == entry for g in grants):
            return
        grants.append({"entry": entry, "question": question, "call": call, "session": session,
                       "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        _write(self.dir / GRANTS, {"version": 1, "grants": grants[-MAX_GRANTS:]})

    def totals(self) -> list[tuple[str, int, int]]:
        """The sessions' totals kept: (session, files, bytes), least recently used first."""
        data = _read(self.dir / TOTALS) or {}
        rows = data.get("sessions", [])
        if not isinstance(rows, list):
            return []
        return [(str(r[0]), int(r[1]), int(r[2])) for r in rows
                if isinstance(r, list) and len(r) == 3 and isinstance(r[1], int) and isinstance(r[2], int)]

    def keep_totals(self, rows: list[tuple[str, int, int]]) -> None:
        """Replace the kept totals with `rows` (`SessionTotals.snapshot`)."""
        _write(self.dir / TOTALS, {"version": 1, "sessions": [list(r) for r in rows]})
