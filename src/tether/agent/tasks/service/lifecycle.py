"""Starting and closing the task service, and settling the tasks a stopped server left unfinished
(see `tether.agent.tasks.service`)."""

from __future__ import annotations

import asyncio
import logging

from tether.agent.run.task import Task, TaskState
from tether.agent.tasks.cluster.ownership import TaskLeases, keep_leases, node_id
from tether.agent.tasks.cluster.peers import TaskPeers
from tether.agent.tasks.restart.graphs import settle_graph
from tether.agent.tasks.restart.plans import SEQ_JUMP, InFlight, in_flight_step, settle_after_restart
from tether.agent.tasks.service.answering import Answering
from tether.protocol.messages import OUTCOME_FINISHED, OUTCOME_RUNNING, CallOutcome, CallRef
from tether.server.store import StoreUnavailable
from tether.server.trust.sessions import claim_task_sessions

logger = logging.getLogger(__name__)


OUTCOME_QUERY_TIMEOUT_S = 10.0  # a device answers an outcome query from memory; an old one never answers
OUTCOME_POLL_S = 1.0  # how often a step the device reports still running is asked about again


class Lifecycle(Answering):
    """The task service's start and close, its task leases, and the settling of unfinished tasks."""

    async def start(self) -> None:
        """Settle the tasks a previous server left unfinished (see the module docstring). Every task owns
        its session (see `tether.server.trust.sessions`), also those stored before owners were recorded. With
        PostgreSQL every statement here runs off the event loop (the task table's worker, the server store's
        pool): a locked table or a slow database delays this start, never the cluster node's heartbeats or the
        hub already running on the loop."""
        table = self.store.table
        ids = await table.call(self.store.ids)
        try:
            await self.server_store.call(claim_task_sessions, self.server_store, ids)
        except StoreUnavailable as exc:  # start-up checked the disk; it filled since: claims come with use
            logger.error("could not record the tasks' session owners: %s", exc)
        settings = self.hub.settings
        leases = self._leases = await table.call(TaskLeases, self.store, node_id(settings), settings.lease_s)
        unfinished = await table.call(self.store.unfinished)

        def claim_all() -> list[tuple[Task, str | None]]:
            """Each unfinished task, and None when this node holds it now, else who does (or "")."""
            return [(task, None if leases.claim(task.id) else leases.holder(task.id) or "") for task in unfinished]

        for task, holder in await table.call(claim_all):
            if holder is None:
                self._resume_after_restart(task)
            else:  # another live server sharing this database runs it
                logger.info("task %s is run by %s", task.id, holder or None)
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
        if self._ending:  # ended tasks' sessions being ended: bounded by their batch timeout
            await asyncio.gather(*self._ending, return_exceptions=True)
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

    async def _take_over(self, task_id: str) -> None:
        """A task whose server stopped renewing its lease: claim it and settle it as a restart does. The task
        is read and claimed on the task table's worker with PostgreSQL (the event loop never waits)."""
        task = await self.store.table.call(self.store.get, task_id)
        if task is None or task.state.terminal or task.id in self._live or self._closing or self._leases is None:
            return
        claimed = await self.store.table.call(self._leases.claim, task.id)
        if claimed and not (task.id in self._live or self._closing):
            logger.warning("task %s: its server stopped; taken over by %s", task.id, self._leases.node)
            seen = task.events[-1].seq if task.events else -1
            self._resume_after_restart(task)
            for event in [e for e in task.events if e.seq > seen]:  # followers here already: what the settling said
                self._on_event(task, event)

    def _lost(self, task_id: str, holder: str | None) -> None:
        """Another server (`holder`, when known) took this task over (this one could not renew its lease in
        time): stop running it here without saving, since the other server owns its record now."""
        logger.error("task %s was taken over by %s; stopping it here", task_id, holder or "another server")
        running = self._runners.pop(task_id, None)
        if running is not None:
            self._given_up.add(task_id)
            running[0].interrupted = True
            running[1].cancel()
        self._live.pop(task_id, None)
        self._held.pop(task_id, None)  # an end not saved yet: the other server's record stands, not told
        self._unsent.pop(task_id, None)  # nor what it did here and could not save
        self._saver.forget(task_id)  # nothing of it written from here again
        self._end_followers(task_id)

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
