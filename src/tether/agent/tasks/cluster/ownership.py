"""Which server runs each unfinished task, when several servers share one database.

A server that starts resumes the unfinished tasks it finds in the store. With one server that is a
restart; with several servers on one PostgreSQL database (or one SQLite file) a server starting
beside a live one would resume that one's running tasks too, and run their steps twice. So each
running task is leased, in the same database as the task, by the node running it:

- `claim` takes a task whose lease is free, expired or already this node's, in one statement that
  only one node can win (an upsert whose update is conditional on the old lease);
- the node renews its leases while it runs (`TaskService`'s keeper, every third of the lease);
- a node that dies stops renewing: when its leases expire, another node's keeper finds the task
  (`orphaned`), claims it and settles it exactly as a restart does — a step that was running asks
  retry / skip / cancel, so nothing is run twice without a person choosing it.

The lease lives with the task rather than in Redis so that the store that says a task is running
is the one that says who runs it: no split brain between two systems, and it works without a
backplane. Leases compare wall clocks of the nodes (time.time()): keep the nodes' clocks in sync (NTP)
well within the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tether.agent.run.task import TERMINAL_STATES, TaskState

if TYPE_CHECKING:
    from tether.agent.tasks.store import TaskStore

logger = logging.getLogger(__name__)

_ENDED = (*(s.value for s in TERMINAL_STATES), TaskState.INTERRUPTED.value)


def node_id(settings: Any) -> str:
    """This server's name in the leases: the cluster node's name (`ServerSettings.node`), so a task's
    lease and its devices' leases name the same node."""
    return str(settings.node)


class TaskLeases:
    """The lease statements, on the TaskStore's table (`TaskTable`: SQLite or PostgreSQL)."""

    def __init__(self, store: TaskStore, node: str, lease_s: float) -> None:
        self.store, self.node, self.lease_s = store, node, lease_s
        self._table = store.table
        self._table.create_leases()

    def claim(self, task_id: str) -> bool:
        """Take the task for this node unless another live node holds it; True when this node holds it now."""
        now = time.time()
        return self._table.claim_lease(task_id, self.node, now + self.lease_s, now)

    def holder(self, task_id: str) -> str | None:
        lease = self._table.lease(task_id)
        return lease[0] if lease is not None and lease[1] >= time.time() else None

    def renew(self, task_ids: list[str]) -> set[str]:
        """Extend this node's leases of these tasks; the ids it no longer holds (taken over meanwhile)."""
        lost = set()
        until = time.time() + self.lease_s
        for task_id in task_ids:
            if not self._table.extend_lease(task_id, self.node, until) and not self.claim(task_id):
                lost.add(task_id)
        return lost

    def release(self, task_id: str) -> None:
        self._table.release_lease(task_id, self.node)

    def orphaned(self) -> list[str]:
        """Unfinished tasks nobody holds (never leased, or their node stopped renewing): oldest first."""
        return self._table.orphaned(_ENDED, time.time())


async def keep_leases(leases: TaskLeases, live: Callable[[], list[str]],
                      take_over: Callable[[str], Awaitable[None]], lost: Callable[[str, str | None], None]) -> None:
    """Renew this node's leases every third of the lease, and take over the tasks whose node stopped
    renewing (`take_over(task_id)`; `lost(task_id, holder)` for a task another node took over from this one).
    A database that cannot be reached is logged and tried again on the next round (the leases then run out,
    and another node — or this one, when the database is back — takes the tasks over).
    """
    every = max(leases.lease_s / 3, 0.05)

    def round_of(held: list[str]) -> tuple[dict[str, str | None], list[str]]:  # the statements, off the loop
        return {task_id: leases.holder(task_id) for task_id in leases.renew(held)}, leases.orphaned()

    while True:
        await asyncio.sleep(every)  # the keeper's period, not a wait for an event: leases are time-based
        try:
            # on the task table's worker (PostgreSQL): a lock on the table or a stalled database holds this
            # keeper, never the event loop
            gone, orphaned = await leases.store.table.call(round_of, live())
            for task_id, holder in gone.items():
                lost(task_id, holder)
            mine = set(live())
            for task_id in orphaned:
                if task_id not in mine:
                    await take_over(task_id)
        except Exception as exc:  # a database away for a while must not end the keeper
            logger.warning("task leases (node %s): %s", leases.node, exc)
