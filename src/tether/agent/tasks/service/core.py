"""The task service's state and its reads: the base of `TaskService` (`tether.agent.tasks.service`)."""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Callable
from typing import Any

from tether.agent.llm.chat import LLMClient
from tether.agent.run.executor import TaskRunner
from tether.agent.run.task import Budgets, Task, TaskEvent
from tether.agent.tasks.cluster.ownership import TaskLeases
from tether.agent.tasks.cluster.peers import TaskPeers
from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.store import SaveSoon, TaskStore
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.hub import DeviceHub
from tether.server.aip.transfer.service import TransferService
from tether.server.notify.notifier import Notifier
from tether.server.store import Store
from tether.server.store.tokens import TokenInfo, scope_reaches

logger = logging.getLogger(__name__)


class ServiceCore:
    """What every part of the task service holds (see `TaskService` for the arguments), and the reads:
    a task by id or prefix, the list, waiting for one, and which devices and tokens a task reaches."""

    def __init__(self, hub: DeviceHub, registry: DeviceRegistry, store: TaskStore,
                 llm: LLMClient | None = None, *, server_store: Store, budgets: Budgets | None = None,
                 command_timeout: float = 600.0, device_wait: float = 30.0,
                 transfers: TransferService | None = None, notifier: Notifier | None = None) -> None:
        self.hub = hub
        self.notifier = notifier  # webhooks and the approval inbox told of waits and ends (agent/tasks/notices.py)
        self.registry = registry  # the hub's: which devices are known, connected, and what they offer
        self.server_store = server_store  # the server's: the audit log's health and the sessions' owners
        self.device_wait = device_wait
        self.transfers = transfers  # runs `transfer` steps (files between devices); None: the skill is not offered
        self.store = store
        self.llm = llm  # plans and answers; closed by `aclose`
        self.budgets = budgets or Budgets()
        self.command_timeout = command_timeout
        self._live: dict[str, Task] = {}
        self._runners: dict[str, tuple[TaskRunner, asyncio.Task[Any]]] = {}
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._answers: dict[str, str] = {}
        self._mcp_questions: dict[str, dict[str, Any]] = {}  # task id → an MCP server's open question
        self._subscribers: dict[str, set[asyncio.Queue[TaskEvent | None]]] = {}
        self._peers: TaskPeers | None = None  # the other nodes of a cluster (agent/tasks/cluster/peers.py)
        self._saver = SaveSoon(store)
        self._closing = False
        self._leases: TaskLeases | None = None  # made at start: which node runs each task (cluster/ownership.py)
        self._keeper: asyncio.Task[None] | None = None
        self._given_up: set[str] = set()  # tasks another server took over while they ran here
        self._asking: dict[str, asyncio.Task[None]] = {}  # tasks whose step in flight is being asked about
        self._checked: dict[str, Task] = {}  # task id given -> the task `steerable` found, while it is steered
        self._ending: set[asyncio.Task[None]] = set()  # ended tasks' sessions being ended on their devices
        # tasks that ended here and whose final state is not written yet: the events held back from every
        # follower, node and webhook until it is (`Running._end`); the task stays live here meanwhile
        self._held: dict[str, list[TaskEvent]] = {}
        # the events of a running task not told yet because the row holding them is not written yet, in order
        # (`Running._on_event`): a follower, node or webhook is told only what a restart would find
        self._unsent: dict[str, list[TaskEvent]] = {}
        # task id → resolved when the answer just given is taken by its runner: the seq of its `user_answer`
        # event, or None when the runner stopped first (`Answering.steer_here` waits on it)
        self._taking: dict[str, asyncio.Future[int | None]] = {}

    def _steerable(self, task_id: str) -> Task:
        """The task, when this server may steer it: not while another live server sharing the database
        runs it (its answer or cancel would be lost in the other server's next save)."""
        checked = self._checked.get(task_id)  # `steerable` found it just now, off the loop
        if checked is not None:
            return checked
        task = self.get(task_id)
        if task.id not in self._live and not task.state.terminal and self._leases is not None:
            holder = self._leases.holder(task.id)
            if holder is not None and holder != self._leases.node:
                raise TaskError(409, f"task {task.id} is run by server {holder}, which shares this server's "
                                     "database: send this to that server", holder=holder)
        return task

    async def steerable(self, task_id: str) -> Task:
        """`_steerable` without holding up the event loop: the task and its lease's holder are read on the task
        table's worker with PostgreSQL (`TaskError` 409 naming the holder when another server runs it)."""
        task = await self.fetch(task_id)
        if task.id not in self._live and not task.state.terminal and self._leases is not None:
            holder = await self.store.table.call(self._leases.holder, task.id)
            if holder is not None and holder != self._leases.node:
                raise TaskError(409, f"task {task.id} is run by server {holder}, which shares this server's "
                                     "database: send this to that server", holder=holder)
        return task

    def _release(self, task_id: str) -> None:
        """Give up this node's lease of the task, after the saves given before (on the task table's worker with
        PostgreSQL: the event loop never waits; at once with SQLite). A failure is logged: the lease runs out."""
        leases = self._leases
        if leases is None:
            return

        def release() -> None:
            try:
                leases.release(task_id)
            except Exception as exc:  # the lease runs out by itself
                logger.warning("could not release the lease of task %s: %s", task_id, exc)

        try:
            self.store.table.submit(release)
        except RuntimeError:  # the table is closed: the lease runs out by itself
            logger.warning("could not release the lease of task %s: the task store is closed", task_id)

    def reaches(self, task: Task, name: str) -> bool:
        """Whether the task's scope (its creator's, when scoped) reaches the device `name`."""
        record = self.registry.get(name)
        return scope_reaches(task.scope_devices, task.scope_tags, name, record.tags if record is not None else ())

    def visible(self, task: Task, token: TokenInfo) -> bool:
        """Whether `token` may see and steer the task: an unscoped token every task, a scoped one the tasks
        whose devices (chosen, named, used) it all reaches, and that were made within a scope it covers."""
        if not token.scoped:
            return True
        names = [n for n in (task.device, *task.devices, *task.devices_used()) if n]
        fans = task.plan is not None and any(s.on == "all" for s in task.plan.steps)
        same = (sorted(task.scope_devices), sorted(task.scope_tags)) == (sorted(token.devices), sorted(token.tags))
        if fans and not same:
            return False  # its steps `on: all` reached the devices of another scope than this token's
        return all(token.reaches(n, r.tags if (r := self.registry.get(n)) is not None else ()) for n in names)

    def stalled(self) -> str | None:
        """One line when the task store has not answered for a while (a lock on its table, a stalled database),
        or when tasks could not be saved (held in memory and retried; a task that ended is not told ended
        meanwhile), else None: what `/health` reports. From state: no statement runs."""
        unsaved = self._saver.unsaved
        problem = self._saver.problem
        failing = (f"{len(unsaved)} task(s) not saved, kept in memory and retried ({problem})"
                   if unsaved and problem else None)
        return "; ".join(r for r in (self.store.table.stalled(), failing) if r) or None

    def ending(self, task_id: str) -> dict[str, Any] | None:
        """A task that ended here but whose end is not saved yet: {"state": its end, "unsaved": why not (None
        while the write is under way)}; else None. Until it is saved the task is shown in the state it ended
        from, which is what the store holds: nobody is told an end a restart would not find."""
        held = self._held.get(task_id)
        if held is None:
            return None
        task = self._live.get(task_id)
        end = task.state.value if task is not None else None
        return {"state": end, "unsaved": self._saver.problem if task_id in self._saver.unsaved else None}

    def shown(self, task: Task, body: dict[str, Any]) -> dict[str, Any]:
        """`body` (the task as a reader gets it: `model_dump` or a list row) as readers must see it: a task whose
        end is held (`ending`) in the state it ended from, with `ending` saying why, and without the held
        events. Anything else as it is."""
        held = self._held.get(task.id)
        cut = self._untold(task.id)
        if cut is not None and isinstance(body.get("events"), list):
            body["events"] = [e for e in body["events"] if e["seq"] < cut]
        if held is None:
            return body
        body["ending"] = self.ending(task.id)
        if held:
            body["state"] = str(held[0].data.get("from") or body["state"])
        return body

    def asked(self, task: Task, question_id: str) -> bool:
        """Whether the question `question_id` of `task` has been told: False while the row that asks it is not
        saved yet (its `question` event waits, `Running._on_event`), so nobody is asked what a restart would not
        find. A question asked before a restart, or not found among the events, has been."""
        cut = self._untold(task.id)
        if cut is None:
            return True
        for event in reversed(task.events):
            if event.seq < cut:
                return True
            if event.kind == "question" and event.data.get("id") == question_id:
                return False
        return True

    def _untold(self, task_id: str) -> int | None:
        """The seq of the task's first event not told yet (not saved yet, or its end held), else None."""
        first = self._unsent.get(task_id) or self._held.get(task_id)
        return first[0].seq if first else None

    def get(self, task_id: str) -> Task:
        """The task with this id or unique id prefix: the live object while it runs, else the stored one."""
        task = self._live.get(task_id) or self._saver.unsaved.get(task_id)
        if task is not None:
            return task
        stored = self.store.get(task_id)  # every task is stored, so this also settles prefixes
        if stored is None:
            raise TaskError(404, f"no task '{task_id}' (or the prefix matches several)")
        return self._live.get(stored.id) or self._saver.unsaved.get(stored.id, stored)

    async def fetch(self, task_id: str) -> Task:
        """`get` without holding up the event loop: a task not in memory is read on the task table's worker
        with PostgreSQL (`TaskTable.call`; `StoreUnavailable` when it does not answer), at once with SQLite."""
        task = self._live.get(task_id) or self._saver.unsaved.get(task_id)
        if task is not None:
            return task
        stored = await self.store.table.call(self.store.get, task_id)
        if stored is None:
            raise TaskError(404, f"no task '{task_id}' (or the prefix matches several)")
        return self._live.get(stored.id) or self._saver.unsaved.get(stored.id, stored)

    async def wait(self, task_id: str) -> Task:
        """The task once its runner has stopped: it ended, or the server is closing under it."""
        task = await self.fetch(task_id)
        running = self._runners.get(task.id)
        if running is not None:
            await asyncio.shield(running[1])
        return task

    def list(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        """Newest first, as `get` shows them: a task in memory (running, or not yet saved because the disk
        is full) is listed with its current state, not the one last stored."""
        memory = {**self._live, **self._saver.unsaved}
        return self._listed(memory, self.store.list(limit + len(memory), state), limit, state, self.shown)

    async def listing(self, limit: int = 50, state: str | None = None) -> builtins.list[dict[str, Any]]:
        """`list` without holding up the event loop: the stored rows are read on the task table's worker with
        PostgreSQL (`TaskTable.call`; `StoreUnavailable` when it does not answer), at once with SQLite."""
        size = limit + len(self._live) + len(self._saver.unsaved)
        stored = await self.store.table.call(self.store.list, size, state)
        return self._listed({**self._live, **self._saver.unsaved}, stored, limit, state, self.shown)

    @staticmethod
    def _listed(memory: dict[str, Task], stored: builtins.list[dict[str, Any]], limit: int,
                state: str | None, shown: Callable[[Task, dict[str, Any]], dict[str, Any]]
                ) -> builtins.list[dict[str, Any]]:
        if not memory:
            return stored[:limit]
        rows = {row["id"]: row for row in stored}
        for task in memory.values():
            rows[task.id] = shown(task, {"id": task.id, "request": task.request, "state": task.state.value,
                                         "device": task.device, "requested_by": task.requested_by,
                                         "created_at": task.created_at.isoformat(),
                                         "updated_at": task.updated_at.isoformat()})
        listed = [row for row in rows.values() if state is None or row["state"] == state]
        listed.sort(key=lambda row: row["updated_at"], reverse=True)
        return listed[:limit]
