"""`TaskService`: tasks on the agent server — run on the hub's devices, stored as they go, answerable.

One `TaskRunner` per live task, each an asyncio task on the server's loop. The service is what the
task API talks to: it creates tasks (choosing the device), feeds answers and approvals to the runner
waiting on them, cancels, streams events to subscribers, and undoes a task on every device it
touched. Every state change, step, decision, question and answer is saved before the next thing
happens, so a server that dies loses at most the streamed output of the step that was running.

After a restart (`start`), or when it takes over a task whose server stopped, each unfinished task is
settled, never forgotten: a step that was in flight is first asked about on its device (its record of
finished calls), and the task resumed from that outcome; it is held with a question for the person only
when the command may or may not have run and the device cannot say (see `tether.agent.tasks.restart`).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from tether.agent.llm.chat import LLMClient
from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.run.executor import TaskRunner
from tether.agent.run.recovery import OPTION_APPROVE, OPTION_DENY, AskUser
from tether.agent.run.steps import discover_tools
from tether.agent.run.task import Budgets, Task, TaskAsker, TaskEvent, TaskState
from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.graph_restart import choose_device, settle_graph
from tether.agent.tasks.notices import tell
from tether.agent.tasks.ownership import TaskLeases, keep_leases, node_id
from tether.agent.tasks.peers import TaskPeers
from tether.agent.tasks.restart import SEQ_JUMP, InFlight, in_flight_step, settle_after_restart
from tether.agent.tasks.store import SaveSoon, TaskStore
from tether.agent.tasks.transfer_step import is_transfer, run_transfer_step, transfer_tool
from tether.errors import AgentError
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.messages import OUTCOME_FINISHED, OUTCOME_RUNNING, CallOutcome, CallRef, Event
from tether.protocol.models import Command, Result, ToolInfo
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.batches import TokenRef
from tether.server.aip.hub import DeviceHub
from tether.server.aip.registry import DeviceRegistry, NoDeviceError
from tether.server.approvals import ApprovalRefused
from tether.server.notify.notifier import Notifier
from tether.server.scopes import beyond, unknown_device
from tether.server.scopes import within as scope_within
from tether.server.sessions import claim_task_sessions, task_owner
from tether.server.store import Store, StoreUnavailable
from tether.server.store.tokens import TokenInfo, scope_reaches
from tether.server.transfer.service import TransferService

logger = logging.getLogger(__name__)

_SUBSCRIBER_QUEUE = 10_000


OUTCOME_QUERY_TIMEOUT_S = 10.0  # a device answers an outcome query from memory; an old one never answers
OUTCOME_POLL_S = 1.0  # how often a step the device reports still running is asked about again


class DeviceUnavailable(AgentError, RuntimeError):
    """A task's device cannot be reached and its tools are unknown, so nothing can be planned or run."""


class _HubDevice(BasicCommandDispatcher):
    """A hub dispatcher with the `emit(kind, data)` hook the runner uses to stream a step's output,
    which also gives a device that is away (a dropped link, a restarted server) `device_wait`
    seconds to come back before a step is sent to it and fails as offline."""

    def __init__(self, hub: DeviceHub, registry: DeviceRegistry, device: str, device_wait: float,
                 before_send: Callable[[], Awaitable[str | None]], within: Callable[[Any], bool] | None = None,
                 transfer: Callable[[Command, float | None], Awaitable[Result]] | None = None, **kwargs: Any) -> None:
        self.emit: Callable[[str, dict[str, Any]], None] | None = None
        self.before_send = before_send
        self.within = within  # the task's device scope, for a step `on: all` (None: every device)
        self.hub = hub
        self.registry = registry
        self.device = device
        self.device_wait = device_wait
        self.transfer = transfer  # runs a `transfer` step (agent/tasks/transfer_step.py)
        self._inner = hub.dispatcher(device, on_event=self._forward, **kwargs)

    def _forward(self, event: Event) -> None:
        if self.emit is not None:
            data = dict(event.data)
            if event.kind == "elicitation":  # answered through the hub, which needs the device's name
                data["device"] = self.device
            self.emit(event.kind, data)

    async def execute_commands(self, commands: list[Command], timeout: float | None = None) -> list[Result]:
        unsaved = await self.before_send()  # the task is saved first, so a restart knows what may have run
        if unsaved is not None:
            return self.generate_error_results(commands, f"not run: the task could not be saved first ({unsaved})")
        known = self.registry.get(self.device) is not None
        if known and not self.hub.connected(self.device) and self.device_wait > 0:
            if self.emit is not None:
                self.emit("waiting_for_device", {"device": self.device, "up_to_s": self.device_wait})
            await self.registry.wait_until(lambda: self.hub.connected(self.device), self.device_wait)
        if self.transfer is not None and is_transfer(commands):
            return [await self.transfer(commands[0], timeout)]
        return await self._inner.execute_commands(commands, timeout=timeout)

    async def fan_out(self, command: Command, requires: DeviceRequirements, timeout: float) -> dict[str, Any]:
        """A step `on: all` (agent/run/steps.py): the command on every matching device through the hub, each
        device's outcome a `fanout_device` event of the step as it arrives."""
        unsaved = await self.before_send()
        if unsaved is not None:
            raise ValueError(f"not run: the task could not be saved first ({unsaved})")

        def told(outcome: Any) -> None:
            if self.emit is not None:
                self.emit("fanout_device", {"device": outcome.device, "status": outcome.status,
                                            "error": outcome.error, "duration": round(outcome.duration, 3)})

        return await self.hub.fan_out(requires, [command], on_outcome=told, timeout=timeout,
                                      requested_by=self._inner.requested_by, within=self.within,
                                      asker=self._inner.asker)


class TaskService:
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
        self._peers: TaskPeers | None = None  # the other nodes of a cluster (agent/tasks/peers.py)
        self._saver = SaveSoon(store)
        self._closing = False
        self._leases: TaskLeases | None = None  # made at start: which node runs each task (agent/tasks/ownership.py)
        self._keeper: asyncio.Task[None] | None = None
        self._given_up: set[str] = set()  # tasks another server took over while they ran here
        self._asking: dict[str, asyncio.Task[None]] = {}  # tasks whose step in flight is being asked about

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Settle the tasks a previous server left unfinished (see the module docstring). Every task owns
        its session (see `tether.server.sessions`), also those stored before owners were recorded."""
        try:
            claim_task_sessions(self.server_store, self.store.ids())
        except StoreUnavailable as exc:  # start-up checked the disk; it filled since: claims come with use
            logger.error("could not record the tasks' session owners: %s", exc)
        settings = self.hub.settings
        self._leases = TaskLeases(self.store, node_id(settings), settings.lease_s)
        for task in self.store.unfinished():
            if self._leases.claim(task.id):
                self._resume_after_restart(task)
            else:  # another live server sharing this database runs it
                logger.info("task %s is run by %s", task.id, self._leases.holder(task.id))
        self._keeper = asyncio.create_task(keep_leases(self._leases, lambda: list(self._live), self._take_over,
                                                       self._lost), name="task leases")
        if self.hub.remote is not None:  # a cluster node: its tasks' followers and steering on every node
            self._peers = TaskPeers(self, self.hub.remote)

    async def aclose(self) -> None:
        """Stop every runner without cancelling its task: the next start resumes or asks."""
        self._closing = True
        if self._peers is not None:
            self._peers.close()
        if self._keeper is not None:
            self._keeper.cancel()
            await asyncio.gather(self._keeper, return_exceptions=True)
        asking = list(self._asking.values())  # unsettled: the next server asks the device again
        for ask in asking:
            ask.cancel()
        await asyncio.gather(*asking, return_exceptions=True)
        runners = list(self._runners.values())
        for runner, job in runners:
            runner.interrupted = True
            job.cancel()
        await asyncio.gather(*(job for _, job in runners), return_exceptions=True)
        problem = await self._saver.saved(*self._live.values())
        self._saver.cancel()
        if problem is not None:
            logger.error("closing with %d task(s) whose last state could not be saved (%s): %s",
                         len(self._saver.unsaved), ", ".join(self._saver.unsaved), problem)
        for task_id in list(self._subscribers):
            self._end_followers(task_id)
        if self._leases is not None and problem is None:  # saved: another server may take them over at once
            for task_id in list(self._live):
                self._release(task_id)
        if self.llm is not None:
            await self.llm.close()

    def _take_over(self, task_id: str) -> None:
        """A task whose server stopped renewing its lease: claim it and settle it as a restart does."""
        task = self.store.get(task_id)
        if task is None or task.state.terminal or task.id in self._live or self._closing:
            return
        if self._leases is not None and self._leases.claim(task.id):
            logger.warning("task %s: its server stopped; taken over by %s", task.id, self._leases.node)
            seen = task.events[-1].seq if task.events else -1
            self._resume_after_restart(task)
            for event in [e for e in task.events if e.seq > seen]:  # followers here already: what the settling said
                self._on_event(task, event)

    def _lost(self, task_id: str) -> None:
        """Another server took this task over (this one could not renew its lease in time): stop running it
        here without saving, since the other server owns its record now."""
        logger.error("task %s was taken over by %s; stopping it here", task_id,
                     self._leases.holder(task_id) if self._leases is not None else "another server")
        running = self._runners.pop(task_id, None)
        if running is not None:
            self._given_up.add(task_id)
            running[0].interrupted = True
            running[1].cancel()
        self._live.pop(task_id, None)
        self._end_followers(task_id)

    def _steerable(self, task_id: str) -> Task:
        """The task, when this server may steer it: not while another live server sharing the database
        runs it (its answer or cancel would be lost in the other server's next save)."""
        task = self.get(task_id)
        if task.id not in self._live and not task.state.terminal and self._leases is not None:
            holder = self._leases.holder(task.id)
            if holder is not None and holder != self._leases.node:
                raise TaskError(409, f"task {task.id} is run by server {holder}, which shares this server's "
                                     "database: send this to that server", holder=holder)
        return task

    def _release(self, task_id: str) -> None:
        if self._leases is not None:
            try:
                self._leases.release(task_id)
            except StoreUnavailable as exc:  # the lease runs out by itself
                logger.warning("could not release the lease of task %s: %s", task_id, exc)

    def _resume_after_restart(self, task: Task) -> None:
        """Settle a task its server left unfinished (`tether.agent.tasks.restart`). When a step was in flight, its
        device is asked first (in the background: the task is held here meanwhile, its lease kept)."""
        graph = bool(task.step_states) and task.state is not TaskState.CREATED  # every branch's step in flight
        flight = None if graph else in_flight_step(task)
        if flight is None and not graph:
            self._settled(task, settle_after_restart(task))
            return
        self._live[task.id] = task
        job = asyncio.create_task(settle_graph(self, task) if flight is None else self._ask_device_first(task, flight),
                                  name=f"task {task.id} outcome")
        self._asking[task.id] = job
        job.add_done_callback(lambda _: self._asking.pop(task.id, None))

    def _settled(self, task: Task, action: str) -> None:
        self._saver.save(task)
        if action == "wait":
            self._live[task.id] = task
        else:
            self._start(task)

    async def _ask_device_first(self, task: Task, flight: InFlight) -> None:
        """Ask the device of the step in flight what became of its call, then settle the task with that: a
        finished step's result is recorded (and its audit row settled, whichever server sent it), a step
        still running is waited for, and only an outcome that stays unknown is put to the person."""
        device = flight.device or task.device
        seen = task.events[-1].seq if task.events else -1
        outcome: CallOutcome | None = None
        why: str | None = "the step names no device"
        try:
            outcome = await self._step_outcome(task, device, flight) if device else None
        except Exception as exc:  # a bug must not leave the task unsettled: the person is asked instead
            logger.exception("task %s: could not ask device %s about step %d", task.id, device, flight.index + 1)
            why = f"the device could not be asked: {exc}"
        if task.id not in self._live or self._closing or task.state.terminal:
            return  # lost to another server or cancelled meanwhile, or shutting down: the next owner asks again
        known = outcome.result if outcome is not None and outcome.state == OUTCOME_FINISHED else None
        why = outcome.note if outcome is not None else why
        if known is not None and device:
            logger.warning("task %s: step %d had finished on device %s before the server stopped (%s): its "
                           "result is taken from the device", task.id, flight.index + 1, device, known.status.value)
            if outcome is not None and outcome.response_id:
                try:
                    self.hub.store.audit.late(device, [(outcome.response_id, flight.call_id, known.status.value,
                                                        known.error)])
                except Exception:
                    logger.exception("task %s: could not settle the audit row of call %s", task.id, flight.call_id)
        self._settled(task, settle_after_restart(task, known=known, unknown_why=why))
        for event in [e for e in task.events if e.seq > seen]:  # what the settling said, to followers here
            self._on_event(task, event)

    async def _step_outcome(self, task: Task, device: str, flight: InFlight) -> CallOutcome:
        """The device's outcome of the step in flight: after waiting up to `device_wait` for the device to
        (re)connect, and while it reports the call `running`, asking again until it is not (at most the
        command timeout)."""
        if not self.hub.connected(device) and self.device_wait > 0:
            await self.registry.wait_until(lambda: self.hub.connected(device), self.device_wait)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.command_timeout
        told = False
        while True:
            outcome = (await self.hub.query_outcomes(device, [CallRef(call_id=flight.call_id)],
                                                     OUTCOME_QUERY_TIMEOUT_S))[flight.call_id]
            if outcome.state != OUTCOME_RUNNING or loop.time() >= deadline:
                return outcome
            if not told:
                told = True
                last = task.events[-1].seq if task.events else -1  # past what followers may have seen
                self._on_event(task, task.record("waiting_for_step", {"step": flight.index, "device": device,
                                                                      "call_id": flight.call_id},
                                                 seq=(last // SEQ_JUMP + 1) * SEQ_JUMP))
            await asyncio.sleep(OUTCOME_POLL_S)

    # -- creating and reading -------------------------------------------------------------------------

    async def create(self, request: str, *, plan: Plan | None = None, device: str | None = None,
                     requires: DeviceRequirements | None = None, devices: list[str] | None = None,
                     requested_by: str | None = None, confirm: str = "never", token: TokenInfo | None = None) -> Task:
        """Create a task on `device` (or on the device `requires` selects) and start it. `confirm`
        (never|destructive|always, the creating token's setting) makes it wait for its plan's confirmation.
        `token` (the creator's): a scoped one's task reaches only the devices in its scope, now and at every
        step (the device chosen, the devices named, a step `on: all`), and it keeps that scope after a restart;
        the task acts for it (`Task.asker`, saved with the task): the questions its steps' MCP servers ask are
        that token's, as a plain command's are its caller's (`approvals.check_answerer`)."""
        if self._closing:
            raise TaskError(503, "the server is shutting down")
        if not request and (plan is None or not plan.steps):
            raise TaskError(422, "give a request in plain words, or a plan with at least one step")
        if plan is None and self.llm is None:
            raise TaskError(409, "this server has no LLM configured, so it cannot plan a request; give a plan "
                                 "instead, or start the server with TETHER_LLM_BASE_URL and TETHER_LLM_MODEL set")
        target = self._pick(device, requires, token)
        extra = list(dict.fromkeys([*(devices or []), *(s.device for s in (plan.steps if plan else []) if s.device)]))
        for name in extra:
            self._in_scope(token, name, "a device the task names")
            if self.registry.get(name) is None:
                raise TaskError(404, f"the plan names device '{name}', which has never registered")
        task = Task(request=request or "run the given plan", plan=plan, device=target, requested_by=requested_by,
                    devices=[n for n in extra if n != target], confirm=confirm,
                    scope_devices=list(token.devices) if token is not None else [],
                    scope_tags=list(token.tags) if token is not None else [],
                    asker=TaskAsker(name=token.name, agent=token.agent, sample=token.allows("sample"))
                    if token is not None else None)
        unaudited = self.server_store.audit.problem()
        if unaudited is not None:  # its commands could not be audited, so they would not run
            raise TaskError(503, f"no task was created: {unaudited}")
        remote = self.hub.remote
        away = [n for n in (target, *task.devices) if not self.hub.holds(n)] if remote is not None else []
        # a cluster node cut off from its backplane
        if away and remote is not None and (problem := remote.problem()) is not None:
            raise TaskError(503, f"no task was created: {problem}; device {away[0]} is not connected to this node")
        try:
            owner = await self.server_store.call(self.server_store.sessions.claim, task.id, task_owner(task.id))
            if owner != task_owner(task.id):
                raise TaskError(409, f"session {task.id} is already taken; create the task again")
            await self.store.saved(task)
        except StoreUnavailable as exc:
            raise TaskError(503, f"no task was created: {exc}") from None
        self._start(task)
        return task

    async def dry_run(self, request: str, *, plan: Plan | None = None, device: str | None = None,
                      requires: DeviceRequirements | None = None, devices: list[str] | None = None,
                      token: TokenInfo | None = None) -> tuple[str, list[PlanStep], list[str]]:
        """(the device, the plan, its problems) for a task that is planned or checked and never run."""
        if not request and (plan is None or not plan.steps):
            raise TaskError(422, "give a request in plain words, or a plan with at least one step")
        if plan is None and self.llm is None:
            raise TaskError(409, "this server has no LLM configured, so it cannot plan a request; give a plan")
        target = self._pick(device, requires, token)
        for name in [*(devices or []), *(s.device for s in (plan.steps if plan else []) if s.device)]:
            self._in_scope(token, name, "a device the task names")
        task = Task(request=request or "run the given plan", plan=plan, device=target, devices=list(devices or []),
                    scope_devices=list(token.devices) if token is not None else [],
                    scope_tags=list(token.tags) if token is not None else [])
        runner = TaskRunner(lambda name: self._dispatcher(task, name), self.llm, tools={}, ask=self._asker(task),
                            budgets=self.budgets, default_device=target)
        try:
            runner.tools = await self._tools_for(task)
        except DeviceUnavailable as exc:
            raise TaskError(409, str(exc)) from None
        runner.profiles = {name: record.profile for name in runner.tools if name is not None
                           and (record := self.registry.get(name)) is not None and record.profile is not None}
        problems = await runner.dry_run(task)
        return target, list(task.plan.steps) if task.plan is not None else [], problems

    def _in_scope(self, token: TokenInfo | None, name: str, what: str) -> None:
        """404 (as for a device that never registered) when a scoped token does not reach `name`."""
        if token is not None and token.scoped:
            record = self.registry.get(name)
            if not token.reaches(name, record.tags if record is not None else ()):
                raise TaskError(404, f"{what}: {unknown_device(token, name)}")

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

    def _pick(self, device: str | None, requires: DeviceRequirements | None, token: TokenInfo | None = None) -> str:
        if device is not None:
            self._in_scope(token, device, "the task's device")
            record = self.registry.get(device)
            if record is None:
                raise TaskError(404, f"no device named '{device}'")
            if record.status == "offline":
                raise TaskError(409, f"device '{device}' is offline")
            return device
        try:
            return self.registry.select(requires or DeviceRequirements(),
                                            scope_within(token) if token is not None else None).name
        except NoDeviceError as exc:
            raise TaskError(409, str(exc) + (beyond(token) if token is not None else "")) from None

    def stalled(self) -> str | None:
        """One line when the task store has not answered for a while (a lock on its table, a stalled database),
        else None: what `/health` reports. From state: no statement runs."""
        return self.store.table.stalled()

    def get(self, task_id: str) -> Task:
        """The task with this id or unique id prefix: the live object while it runs, else the stored one."""
        task = self._live.get(task_id) or self._saver.unsaved.get(task_id)
        if task is not None:
            return task
        stored = self.store.get(task_id)  # every task is stored, so this also settles prefixes
        if stored is None:
            raise TaskError(404, f"no task '{task_id}' (or the prefix matches several)")
        return self._live.get(stored.id) or self._saver.unsaved.get(stored.id, stored)

    async def wait(self, task_id: str) -> Task:
        """The task once its runner has stopped: it ended, or the server is closing under it."""
        task = self.get(task_id)
        running = self._runners.get(task.id)
        if running is not None:
            await asyncio.shield(running[1])
        return task

    def list(self, limit: int = 50, state: str | None = None) -> list[dict[str, Any]]:
        """Newest first, as `get` shows them: a task in memory (running, or not yet saved because the disk
        is full) is listed with its current state, not the one last stored."""
        memory = {**self._live, **self._saver.unsaved}
        if not memory:
            return self.store.list(limit, state)
        rows = {row["id"]: row for row in self.store.list(limit + len(memory), state)}
        for task in memory.values():
            rows[task.id] = {"id": task.id, "request": task.request, "state": task.state.value,
                             "device": task.device, "requested_by": task.requested_by,
                             "created_at": task.created_at.isoformat(),
                             "updated_at": task.updated_at.isoformat()}
        shown = [row for row in rows.values() if state is None or row["state"] == state]
        shown.sort(key=lambda row: row["updated_at"], reverse=True)
        return shown[:limit]

    # -- running ----------------------------------------------------------------------------------------

    def _start(self, task: Task) -> None:
        if self._leases is not None:  # a new task, or one this server just claimed: it holds the lease
            self.store.table.submit(partial(self._leases.claim, task.id))  # in order, the loop never waits
        self._live[task.id] = task
        runner = TaskRunner(lambda name: self._dispatcher(task, name), self.llm, tools={}, ask=self._asker(task),
                            on_event=lambda event: self._on_event(task, event), budgets=self.budgets,
                            command_timeout=self.command_timeout, default_device=task.device or "device",
                            stream_planning=True,  # planning_progress events: followers show the token count
                            choose=lambda req: choose_device(self, task, req))
        job = asyncio.create_task(self._drive(task, runner), name=f"task {task.id}")
        self._runners[task.id] = (runner, job)

    async def _drive(self, task: Task, runner: TaskRunner) -> None:
        try:
            runner.tools = await self._tools_for(task)
            runner.profiles = {name: record.profile for name in runner.tools if name is not None
                               and (record := self.registry.get(name)) is not None and record.profile is not None}
            await runner.run(task)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # a bug or an unreachable device must end the task clearly, not silently
            if not isinstance(exc, DeviceUnavailable):
                logger.exception("task %s stopped on an error", task.id)
            if not task.state.terminal:
                task.error = f"the task stopped on an error: {exc}"
                self._on_event(task, task.transition(TaskState.FAILED, error=task.error))
        finally:
            self._runners.pop(task.id, None)
            if task.id in self._given_up:  # its record is the other server's now: nothing saved from here
                self._given_up.discard(task.id)
            else:
                self._saver.save(task)  # never raises: unsaved, it is kept (get and list show it) and retried
            if task.state.terminal and self._live.get(task.id) is task:
                self._live.pop(task.id, None)
                self._end_followers(task.id)
                if self._peers is not None:
                    self._peers.ended(task.id)
                self._release(task.id)

    async def _tools_for(self, task: Task) -> dict[str | None, builtins.list[ToolInfo]]:
        """Each device's tools, asked live (tools change), else from the profile it registered with."""
        tools: dict[str | None, list[ToolInfo]] = {}
        for name in dict.fromkeys(n for n in [task.device, *task.devices] if n):
            tools[name] = await self._device_tools(name)
            if self.transfers is not None:
                tools[name].append(transfer_tool())
        tools[None] = tools[task.device] if task.device else []
        return tools

    async def _device_tools(self, name: str) -> builtins.list[ToolInfo]:
        record = self.registry.get(name)
        if record is not None and record.status != "offline":
            try:
                return await discover_tools(self.hub.dispatcher(name, requested_by="tether:tasks"))
            except RuntimeError:
                pass
        if record is not None and record.profile is not None:
            return list(record.profile.tools)
        raise DeviceUnavailable(f"device '{name}' is offline and has never reported its tools")

    def _dispatcher(self, task: Task, name: str | None) -> BasicCommandDispatcher:
        device = name or task.device
        if device is None:
            raise RuntimeError("the task has no device")
        before_send = self._saver.flushed
        if not self.reaches(task, device):  # a step (planned by the LLM, or given) naming a device beyond it
            async def before_send() -> str | None:
                return (f"device '{device}' is outside the scope of the token that created the task "
                        f"(devices {', '.join(task.scope_devices) or '-'}; tags {', '.join(task.scope_tags) or '-'})")
        scoped = bool(task.scope_devices or task.scope_tags)
        requested_by = f"task:{task.id[:12]} for {task.requested_by or 'unknown'}"
        transfers = self.transfers

        async def transfer(command: Command, timeout: float | None) -> Result:
            assert transfers is not None and device is not None
            return await run_transfer_step(transfers, command, device, session_id=task.id, requested_by=requested_by,
                                           reaches=lambda name: self.reaches(task, name), timeout=timeout)

        return _HubDevice(self.hub, self.registry, device, self.device_wait, before_send,
                          transfer=transfer if transfers is not None else None,
                          within=(lambda r: scope_reaches(task.scope_devices, task.scope_tags, r.name, r.tags))
                          if scoped else None,
                          session_id=task.id, requested_by=f"task:{task.id[:12]} for {task.requested_by or 'unknown'}",
                          asker=task_asker(task))

    def _asker(self, task: Task) -> Callable[[AskUser], Any]:
        async def ask(question: AskUser) -> str:
            if task.id in self._answers:  # answered while no runner was waiting (after a restart)
                return self._answers.pop(task.id)
            future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._waiting[task.id] = future
            try:
                return await future
            finally:
                self._waiting.pop(task.id, None)

        return ask

    def _on_event(self, task: Task, event: TaskEvent | None) -> None:
        if event is None:
            return
        self._saver.on_event(task, event)
        if event.kind == "elicitation" and "id" in event.data and "declined" not in event.data:
            self._mcp_questions[task.id] = dict(event.data)
        elif event.kind in ("elicitation_answered", "step_finished"):
            self._mcp_questions.pop(task.id, None)
        if self._peers is not None:  # followers on the other nodes of a cluster
            self._peers.event(task.id, event)
        self.feed(task.id, event)
        if self.notifier is not None:
            tell(self.notifier, self.registry, task, event)

    async def steer(self, task_id: str, action: str, by: str, **args: Any) -> Task | dict[str, Any]:
        """Answer, approve or cancel a task: here, or in a cluster on the node that runs it (its summary
        then). The caller checked the token's scopes; the node that runs the task checks the rest."""
        try:
            return await self.steer_here(task_id, action, by, args)
        except TaskError as exc:
            if exc.holder is None or self._peers is None:
                raise
            return await self._peers.steer(exc.holder, task_id, action, by, args)

    async def steer_here(self, task_id: str, action: str, by: str, args: dict[str, Any]) -> Task:
        if action == "answer":
            task = self.answer(task_id, str(args.get("answer", "")), args.get("question_id"), by,
                               digest=args.get("digest"))
        elif action == "approve":
            task = self.approve(task_id, bool(args.get("approved")), by, digest=args.get("digest"))
        elif action == "cancel":
            return await self.cancel(task_id)
        else:
            raise TaskError(400, f"unknown action {action!r}")
        await asyncio.sleep(0)  # one turn of the loop: the waiting runner takes the answer, so the reply is current
        return task

    def is_running_here(self, task_id: str) -> bool:
        return task_id in self._live

    def has_followers(self, task_id: str) -> bool:
        return task_id in self._subscribers

    def feed(self, task_id: str, event: TaskEvent) -> None:
        """Give the followers of the task here its next event."""
        for queue in list(self._subscribers.get(task_id, ())):
            if queue.qsize() < _SUBSCRIBER_QUEUE - 1:
                queue.put_nowait(event)
            else:  # a follower this far behind is ended, not fed a gap: it resumes with ?after=SEQ
                self._subscribers[task_id].discard(queue)
                queue.put_nowait(None)

    # -- people -----------------------------------------------------------------------------------------

    def answer(self, task_id: str, answer: str, question_id: str | None = None, by: str | None = None, *,
               digest: str | None = None) -> Task:
        """Answer the task's open question; the same task goes on from where it stopped. `by` is who
        answered (an approved command carries it as `approved_by`, so the audit log names them).
        `digest`, when given, is the question's `digest` as the answerer was shown it: refused (409) when
        the open question shows something else now."""
        task = self._steerable(task_id)
        pending = task.pending_question
        if task.state is not TaskState.WAITING_FOR_USER or pending is None:
            raise TaskError(409, f"task {task.id} has no open question (it is {task.state.value})")
        if question_id is not None and question_id != pending.id:
            raise TaskError(409, f"question {question_id} is not the open one (that is {pending.id})")
        if digest is not None and digest != pending.digest:
            raise TaskError(409, f"what you were shown (digest {digest[:24]}) is not what waits now (question "
                                 f"{pending.id}, digest {(pending.digest or 'none')[:24]}): look at it again, nothing "
                                 "was approved")
        if not answer.strip():
            raise TaskError(422, f"the answer is empty; the options are: {', '.join(pending.options)}")
        pending.answered_by = by
        waiting = self._waiting.get(task.id)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)
        elif task.id not in self._runners:
            self._answers[task.id] = answer
            self._start(task)
        else:
            raise TaskError(409, f"task {task.id} is not waiting for an answer right now")
        return task

    def mcp_question(self, task_id: str) -> dict[str, Any] | None:
        """The question an external MCP server asks during the task's running step, if one is open."""
        return self._mcp_questions.get(self.get(task_id).id)

    async def answer_mcp_question(self, task_id: str, answer: str, by: str, *, answerer: TokenRef) -> bool:
        """Answer it (`tether answer` works for it as for the task's own questions): decline/cancel/no,
        else the value of its only field, or a JSON object of its fields; False when none is open.

        `answerer` is the API token answering; the question is the task's asker's (`Task.asker`), so the hub
        refuses (TaskError 403, the question still waits) whoever may not answer it: an agent's token always,
        another token than the asker's for a person's task (with four-eyes on, a consent question needs
        another person than the asker), and anyone but a person for an agent's task."""
        task = self._steerable(task_id)
        question = self._mcp_questions.get(task.id)
        if question is None:
            return False
        action, content = mcp_answer(question.get("schema") or {}, answer)
        try:
            sent = await self.hub.answer_question(str(question.get("device")), str(question["id"]), action, content,
                                                  by=by, answerer=answerer)
        except ApprovalRefused as exc:
            raise TaskError(exc.status, str(exc)) from None
        except LookupError as exc:
            raise TaskError(409, str(exc)) from None
        self._mcp_questions.pop(task.id, None)
        if not sent:
            raise TaskError(409, f"the MCP server's question {question['id']} is no longer waiting for an answer")
        return True

    def approve(self, task_id: str, approved: bool, by: str | None = None, *, digest: str | None = None) -> Task:
        task = self._steerable(task_id)
        pending = task.pending_question
        if pending is not None and pending.kind == "confirmation" and task.state is TaskState.WAITING_FOR_USER:
            return self.answer(task.id, "run" if approved else "cancel", pending.id, by,  # a plan to confirm
                               digest=digest)
        if pending is None or pending.kind != "approval" or task.state is not TaskState.WAITING_FOR_USER:
            raise TaskError(409, f"task {task.id} has no action waiting for approval (it is {task.state.value}"
                                 + (f", asking: {pending.question}" if pending else "") + ")")
        return self.answer(task.id, OPTION_APPROVE if approved else OPTION_DENY, pending.id, by, digest=digest)

    async def cancel(self, task_id: str) -> Task:
        task = self._steerable(task_id)
        if task.state.terminal:
            raise TaskError(409, f"task {task.id} has already ended ({task.state.value})")
        running = self._runners.get(task.id)
        if running is not None:
            running[1].cancel()
            await asyncio.gather(running[1], return_exceptions=True)
        asking = self._asking.get(task.id)
        if asking is not None:  # its device is being asked about the step in flight: no longer needed
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
        if not task.state.terminal:  # not running (waiting after a restart): end it here
            task.error = "cancelled"
            self._on_event(task, task.transition(TaskState.CANCELLED, error="cancelled"))
            self._saver.save(task)
            self._live.pop(task.id, None)
            self._end_followers(task.id)
            self._release(task.id)
        return task

    # -- events -------------------------------------------------------------------------------------------

    def subscribe(self, task_id: str, after: int = -1
                  ) -> tuple[Task, builtins.list[TaskEvent], asyncio.Queue[TaskEvent | None] | None]:
        """The events so far (after `after`) and, for a task still going, a queue of what comes next
        (None marks the end). Both come from one moment, so nothing is missed or seen twice."""
        task = self.get(task_id)
        past = [e for e in task.events if e.seq > after]
        if task.state.terminal and task.id not in self._runners:
            return task, past, None
        queue: asyncio.Queue[TaskEvent | None] = asyncio.Queue()
        self._subscribers.setdefault(task.id, set()).add(queue)
        return task, past, queue

    def release_followers(self) -> None:
        """The server is stopping: every follower's stream ends now (its `end` says the task is still
        going), before the web server waits on open connections and would cancel them mid-frame."""
        for task_id in list(self._subscribers):
            self._end_followers(task_id)

    def end_followers(self, task_id: str) -> None:
        self._end_followers(task_id)

    def _end_followers(self, task_id: str) -> None:
        """Every follower's stream of this task ends (None): the task ended, or the server closes."""
        for queue in self._subscribers.pop(task_id, set()):
            queue.put_nowait(None)

    def unsubscribe(self, task_id: str, queue: asyncio.Queue[TaskEvent | None]) -> None:
        queues = self._subscribers.get(task_id)
        if queues is not None:
            queues.discard(queue)

    # -- undo -----------------------------------------------------------------------------------------------

    async def undo(self, task_id: str, requested_by: str) -> dict[str, Any]:
        """Put back the files the task changed, on every device its commands ran on, the device that changed
        something last first (a graph's branches ran on several devices at once)."""
        task = self.get(task_id)
        if task.id in self._runners:
            raise TaskError(409, f"task {task.id} is still running; cancel it first")
        report: dict[str, Any] = {}
        for name in task.devices_undo_order():
            dispatcher = self.hub.dispatcher(name, session_id=task.id,
                                             requested_by=f"undo:{task.id[:12]} by {requested_by}")
            command = Command(tool_name="undo_session", parameters={"session_id": task.id},
                              approved_by=requested_by)
            [result] = await dispatcher.execute_commands([command], timeout=120)
            report[name] = {"restored": result.result} if result.ok else {"error": result.error}
        task.record("undone", {"devices": report})
        self._saver.save(task)
        return report


def task_asker(task: Task) -> TokenRef | None:
    """The token `task` acts for, as the hub's batches carry their caller (None: the task recorded none)."""
    return TokenRef(task.asker.name, task.asker.agent, task.asker.sample) if task.asker is not None else None


def mcp_answer(schema: dict[str, Any], answer: str) -> tuple[str, dict[str, Any] | None]:
    """A person's words as an MCP elicitation result: (action, content); TaskError when they do not fit."""
    text = answer.strip()
    if text.lower() in ("decline", "no", "cancel"):
        return ("cancel" if text.lower() == "cancel" else "decline"), None
    props: dict[str, Any] = schema.get("properties") or {}
    if not props:
        return "accept", {}
    if text.startswith("{"):
        try:
            content = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskError(422, f"the answer is not a JSON object: {exc.msg}") from None
        if isinstance(content, dict):
            return "accept", content
    if len(props) != 1:
        raise TaskError(422, f"the question has several fields ({', '.join(props)}): answer with a JSON object")
    [(key, prop)] = props.items()
    kind = prop.get("type")
    try:
        value: Any = {"integer": int, "number": float}.get(str(kind), str)(text)
    except ValueError:
        raise TaskError(422, f"{key}: expected {kind}") from None
    if kind == "boolean":
        value = text.lower() in ("y", "yes", "true", "1")
    return "accept", {key: value}
