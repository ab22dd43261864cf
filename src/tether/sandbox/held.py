"""Layers held for a person's approval: the same layer is applied once approved, so nothing runs twice."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tether.sandbox.layer import Change, discard

HOLD_S = 3600.0
MAX_HELD = 64


@dataclass(slots=True)
class Held:
    layer: Path
    changes: list[Change]
    payload: dict[str, Any]
    since: float = field(default_factory=time.monotonic)


class HeldLayers:
    """Keyed by the command's fingerprint (session, program, arguments, cwd, env, stdin); oldest dropped."""

    def __init__(self, hold_s: float = HOLD_S, limit: int = MAX_HELD) -> None:
        self.hold_s, self.limit = hold_s, limit
        self._held: dict[str, Held] = {}

    def put(self, key: str, held: Held) -> None:
        self._expire()
        old = self._held.pop(key, None)
        if old is not None:
            discard(old.layer)
        while len(self._held) >= self.limit:
            discard(self._held.pop(next(iter(self._held))).layer)
        self._held[key] = held

    def take(self, key: str) -> Held | None:
        self._expire()
        return self._held.pop(key, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, h in self._held.items() if now - h.since > self.hold_s]:
            discard(self._held.pop(key).layer)

    def clear(self) -> None:
        for held in self._held.values():
            discard(held.layer)
        self._held.clear()
