"""`BatchRunner`, made of its parts in this package (`accepting`, `running`, `results`) with its own construction,
load figures and session limit."""

from __future__ import annotations

import asyncio

from tether.device.client import DeviceClient
from tether.device.link.batch import Batch
from tether.device.link.batch_runner.accepting import BatchIntake
from tether.device.link.batch_runner.reasons import DEFAULT_MAX_CONCURRENT_SESSIONS
from tether.device.link.finished import FinishedRecord
from tether.device.link.outbox import Outbox
from tether.device.link.session_line import SessionLine


class BatchRunner(BatchIntake):
    """Accepts COMMAND messages, runs them on a `DeviceClient`, and puts results in the outbox.

    There is no long-lived worker: a finishing batch starts the next one in a task of its own, and a
    batch that can start when it arrives is run by the connection's reader itself, in its own task
    (see `submit(run_here=True)`): no task is created and no event-loop turn is spent for it.
    """

    def __init__(self, client: DeviceClient, outbox: Outbox, record: FinishedRecord,
                 client_id: str | None = None, *,
                 max_concurrent_sessions: int = DEFAULT_MAX_CONCURRENT_SESSIONS) -> None:
        self.client = client
        self.outbox = outbox
        self.record = record
        self.client_id = client_id
        self.active: dict[str, Batch] = {}  # response_id → batch, queued or running
        self.idle = asyncio.Event()
        self.idle.set()
        self.executed = 0  # commands handed to the router (not replayed): tests count on it
        self.line: SessionLine[Batch] = SessionLine(max_concurrent_sessions)  # who runs next
        self._here: Batch | None = None  # the batch `submit` last returned to run in the caller's task
        self._unarmed: Batch | None = None  # that batch, when its timer waits for its first wait (`run_here`)

    @property
    def running(self) -> int:
        """Batches accepted and not finished (queued or running): the heartbeat's load figure."""
        return len(self.active)

    def set_limit(self, max_concurrent_sessions: int) -> None:
        """A new `max_concurrent_sessions` (a policy change): more slots start waiting sessions at once;
        fewer let the running ones finish."""
        self.line.limit = max(1, max_concurrent_sessions)
        self._pump()

    @property
    def started(self) -> int:
        """Batches running now (each session's current one, and listings)."""
        return self.line.started

    @property
    def queued(self) -> int:
        """Batches accepted and not started: behind their session's running batch, or waiting for a slot."""
        return len(self.active) - self.started
