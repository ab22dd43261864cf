"""Layers held for a person's approval: the same layer is applied once approved, so nothing runs twice.

A held layer is also written down beside itself (`held.json` in the layer directory), so the approval
can come from another process of the same user — `tether exec --approve --session S …` after a
`tether exec` that was held, or a device restarted between the question and the answer — and still
apply what the command did then instead of running it again. Taking a layer removes its note first,
so it is applied at most once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.sandbox.layers.layer import Change, discard

HOLD_S = 3600.0
MAX_HELD = 64
NOTE = "held.json"


@dataclass(slots=True)
class Held:
    layer: Path
    changes: list[Change]
    payload: dict[str, Any]
    since: float = field(default_factory=time.time)


class HeldLayers:
    """Keyed by the command's fingerprint (session, program, arguments, cwd, env, stdin); oldest dropped.

    Safe to call from several threads (the sandbox's workers put and take off the event loop).
    """

    def __init__(self, root: Path | None = None, hold_s: float = HOLD_S, limit: int = MAX_HELD) -> None:
        self.root, self.hold_s, self.limit = root, hold_s, limit
        self._held: dict[str, Held] = {}
        self._lock = threading.RLock()

    def put(self, key: str, held: Held) -> None:
        with self._lock:
            self._put(key, held)

    def _put(self, key: str, held: Held) -> None:
        self._expire()
        old = self._held.pop(key, None)
        if old is not None:
            discard(old.layer)
        while len(self._held) >= self.limit:
            discard(self._held.pop(next(iter(self._held))).layer)
        self._held[key] = held
        _write_note(key, held)

    def take(self, key: str) -> Held | None:
        with self._lock:
            return self._take(key)

    def _take(self, key: str) -> Held | None:
        self._expire()
        held = self._held.pop(key, None)
        if held is not None:
            with contextlib.suppress(OSError):
                os.unlink(held.layer / NOTE)
            return held
        return self._take_from_disk(key)

    def peek(self, key: str) -> Held | None:
        """The layer held under `key`, left held (in memory, else its note on disk): what an approval is
        checked against before anything is taken."""
        with self._lock:
            return self._peek(key)

    def _peek(self, key: str) -> Held | None:
        self._expire()
        held = self._held.get(key)
        if held is not None:
            return held
        if self.root is None or not self.root.is_dir():
            return None
        for note in self.root.glob(f"L*/{NOTE}"):
            data = _read_note(note, self.hold_s)
            if data is not None and data.get("key") == key:
                return _from_note(note, data)
        return None

    def _take_from_disk(self, key: str) -> Held | None:
        if self.root is None or not self.root.is_dir():
            return None
        now = time.time()
        for note in self.root.glob(f"L*/{NOTE}"):
            try:
                if os.lstat(note).st_uid != os.getuid():
                    continue
                data = json.loads(note.read_text())
            except (OSError, ValueError):
                continue
            if now - data.get("since", 0) > self.hold_s:
                discard(note.parent)
                continue
            if data.get("key") != key:
                continue
            try:
                os.unlink(note)  # whoever unlinks it owns the layer: at most one apply
            except OSError:
                return None
            changes = [Change(**{**c, "was": tuple(c["was"]) if c.get("was") else None}) for c in data["changes"]]
            return Held(note.parent, changes, data["payload"], data["since"])
        return None

    def _expire(self) -> None:
        now = time.time()
        for key in [k for k, h in self._held.items() if now - h.since > self.hold_s]:
            discard(self._held.pop(key).layer)

    def clear(self) -> None:
        """Forget what this process holds; the layers stay on disk (with their notes) for a later approval."""
        with self._lock:
            self._held.clear()


def _write_note(key: str, held: Held) -> None:
    note = {"key": key, "since": held.since, "payload": held.payload,
            "changes": [dataclasses.asdict(c) for c in held.changes]}
    tmp = held.layer / f".{NOTE}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "w") as f:
            json.dump(note, f)
        os.replace(tmp, held.layer / NOTE)
    except (OSError, TypeError, ValueError):
        pass  # held in memory only: an approval from this process still applies it


def _read_note(note: Path, hold_s: float) -> dict[str, Any] | None:
    """A note of this user's, not expired, as written; None otherwise (nothing is removed here)."""
    try:
        if os.lstat(note).st_uid != os.getuid():
            return None
        data = json.loads(note.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and time.time() - data.get("since", 0) <= hold_s else None


def _from_note(note: Path, data: dict[str, Any]) -> Held:
    changes = [Change(**{**c, "was": tuple(c["was"]) if c.get("was") else None}) for c in data["changes"]]
    return Held(note.parent, changes, data["payload"], data["since"])
