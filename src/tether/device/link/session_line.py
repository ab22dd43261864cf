"""`SessionLine`: which batch runs next on a device that serves several sessions at once.

Pure bookkeeping, no asyncio: `BatchRunner` asks it which batches may start and which waiting ones
must be told a new place. The rules: a session's batches start one at a time, in arrival order; at
most `limit` sessions hold a slot at once; sessions without a slot wait in arrival order, and a
session with more batches queues again behind those already waiting when its batch ends (no session
keeps a slot for ever). Batches that only list tools (`immediate`) never wait and hold no slot.
A batch cancelled while it waits is skipped (its `done` is set by the runner).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, TypeVar


class Waiting(Protocol):
    """What the line needs of a batch (`tether.device.link.batch_runner.Batch`)."""

    done: bool
    position: int  # its place as last reported: 1 = next; 0 = not waiting for a slot

    @property
    def session(self) -> str | None: ...


B = TypeVar("B", bound=Waiting)


class SessionLine(Generic[B]):
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_sessions must be at least 1, not {limit}")
        self.limit = limit
        self._queues: dict[str | None, deque[B]] = {}  # per session: its batches not started yet
        self._running: dict[str | None, B] = {}  # per session: the batch holding its slot
        self._waiting: deque[str | None] = deque()  # sessions with batches and no slot, in arrival order
        self.immediate: set[B] = set()  # listings running outside the slots

    @property
    def started(self) -> int:
        """Batches running now (each session's current one, and listings)."""
        return len(self._running) + len(self.immediate)

    def add(self, batch: B) -> None:
        """A new batch joins its session's queue; `take` says whether it may start."""
        key = batch.session
        self._queues.setdefault(key, deque()).append(batch)
        if key not in self._running and key not in self._waiting:
            self._waiting.append(key)

    def take(self) -> list[B]:
        """The batches that get a free slot now, in the order they waited (each now holds its slot)."""
        started: list[B] = []
        while self._waiting and len(self._running) < self.limit:
            key = self._waiting.popleft()
            batch = self._head(key)
            if batch is None:
                continue
            self._queues[key].popleft()
            if not self._queues[key]:
                del self._queues[key]
            batch.position = 0
            self._running[key] = batch
            started.append(batch)
        return started

    def moved(self) -> list[tuple[B, int]]:
        """The waiting batches whose place changed since it was last reported, with their new place
        (sessions whose waiting batches were all cancelled leave the line first)."""
        if not self._waiting:  # the common case: nobody waits
            return []
        self._waiting = deque(key for key in self._waiting if self._head(key) is not None)
        changed: list[tuple[B, int]] = []
        for place, key in enumerate(self._waiting, 1):
            head = self._head(key)
            if head is not None and head.position != place:
                head.position = place
                changed.append((head, place))
        return changed

    def ended(self, batch: B) -> None:
        """A batch is over: its slot is free; its session, if it has more batches, queues again."""
        self.immediate.discard(batch)
        key = batch.session
        if self._running.get(key) is batch:
            del self._running[key]
            if self._head(key) is not None:
                self._waiting.append(key)

    def _head(self, key: str | None) -> B | None:
        """The session's next batch not cancelled meanwhile (cancelled ones are dropped)."""
        queue = self._queues.get(key)
        while queue and queue[0].done:
            queue.popleft()
        if not queue:
            self._queues.pop(key, None)
            return None
        return queue[0]
