"""Running a task: one `TaskRunner` per live task, its steps sent to the hub's devices, its events saved and fed."""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from tether.agent.run.decisions import AskUser
from tether.agent.run.executor import TaskRunner
from tether.agent.run.steps import discover_tools
from tether.agent.run.task import Task, TaskEvent, TaskState
from tether.agent.tasks.notices import tell
from tether.agent.tasks.restart.graphs import choose_device
from tether.agent.tasks.service.followers import Followers
from tether.agent.tasks.transfer_step import is_transfer, run_transfer_step, transfer_tool
from tether.errors import AgentError
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.messages import Event
from tether.protocol.models import Command, Result, ToolInfo
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.fleet.registry import DeviceRegistry
from tether.server.aip.hub import DeviceHub
from tether.server.store.tokens import scope_reaches

logger = logging.getLogger(__name__)


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



class Running(Followers):
    """The task service's runners: starting one on a task, the devices it reaches, what it is told."""

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
            taking = self._taking.pop(task.id, None)
            if taking is not None and not taking.done():  # an answer given that it never took
                taking.set_result(None)
            if task.id in self._given_up:  # its record is the other server's now: nothing saved from here
                self._given_up.discard(task.id)
                self._held.pop(task.id, None)
                self._unsent.pop(task.id, None)
            elif task.state.terminal and self._live.get(task.id) is task:
                self._end(task)
            else:
                self._saver.save(task)  # never raises: unsaved, it is kept (get and list show it) and retried

    def _end(self, task: Task) -> None:
        """The task has ended here: save its final state, and only once that is written tell its end — the
        events held since its terminal state (`_on_event`) to followers here, the other nodes and webhooks, the
        followers' `end`, the other nodes' end, its lease given up, its devices' sessions ended. A write that
        fails (a full disk, a database away) is retried (`SaveSoon`) and the end waits for it: the task stays
        live here meanwhile (its lease renewed, shown in the state it ended from, `/health` degraded). A server
        that stops first leaves the store's older row, which its restart settles as any unfinished task."""
        self._held.setdefault(task.id, [])
        self._saver.save_then(task, partial(self._told_end, task))

    def _told_end(self, task: Task) -> None:
        held = self._held.pop(task.id, None)
        unsent = self._unsent.pop(task.id, [])  # before its end, in the same row
        if held is None or self._live.get(task.id) is not task:  # taken over by another server meanwhile
            return
        self._live.pop(task.id, None)
        for event in [*unsent, *held]:
            self._relay(task, event)
        self._end_followers(task.id)
        if self._peers is not None:  # after its final row is written: the others read their end from it
            self._peers.ended(task.id)
        self._release(task.id)
        self._end_sessions(task)

    def _end_sessions(self, task: Task) -> None:
        """The task has ended: each connected device it sent commands to (or could have) is told that its
        session has (`end_session`), in the background, so it drops what it kept for the session alone (a
        private /tmp). Nothing is retried: a device away now, or one too old to know the meta tool,
        removes that itself once the session has been idle for a day."""
        names = [n for n in dict.fromkeys([*task.devices_undo_order(), *(n for n in [task.device, *task.devices] if n)])
                 if self.hub.connected(n)]
        if not names or self._closing:
            return

        async def end(name: str) -> None:
            dispatcher = self.hub.dispatcher(name, session_id=task.id, requested_by=f"task:{task.id[:12]} ended")
            [result] = await dispatcher.execute_commands([Command(tool_name="end_session")], timeout=30)
            if not result.ok:
                logger.debug("task %s: device %s did not end its session: %s", task.id, name, result.error)

        async def end_all() -> None:
            await asyncio.gather(*(end(name) for name in names), return_exceptions=True)

        job = asyncio.create_task(end_all(), name=f"task {task.id} sessions end")
        self._ending.add(job)
        job.add_done_callback(self._ending.discard)

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
        """Record what `event` changes here and tell it — once it is saved. A task's events (its plan, steps,
        questions, answers, states) are relayed to followers, the other nodes and webhooks only once a row
        holding them is written (`SaveSoon.then`: the write of this turn of the loop), in order; through a
        failing store they wait, with the write retried. Only streamed output (`STREAMED`) is told at once
        when nothing waits before it: it is saved with the next event that is, and a restart before that
        loses it. The task's end waits for its own save (`_end`)."""
        if event is None:
            return
        self._saver.on_event(task, event)
        if event.kind == "elicitation" and "id" in event.data and "declined" not in event.data:
            self._mcp_questions[task.id] = dict(event.data)
        elif event.kind in ("elicitation_answered", "step_finished"):
            self._mcp_questions.pop(task.id, None)
        elif event.kind == "user_answer":
            taking = self._taking.pop(task.id, None)
            if taking is not None and not taking.done():
                taking.set_result(event.seq)
        held = self._held.get(task.id)
        if held is None and event.kind == "state" and task.state.terminal:
            held = self._held[task.id] = []
        if held is not None:  # its end and what follows it: told once saved (`_end`)
            held.append(event)
            return
        unsent = self._unsent.get(task.id)
        if unsent is None:
            if event.kind in STREAMED:
                self._relay(task, event)
                return
            unsent = self._unsent[task.id] = []
            self._saver.then(task, partial(self._saved_to, task, unsent))
        unsent.append(event)

    def _saved_to(self, task: Task, unsent: builtins.list[TaskEvent], seq: int) -> None:
        """A row of `task` holding its events up to `seq` is written: tell those of `unsent` (in order); what
        came after waits for the next write."""
        if self._unsent.get(task.id) is not unsent:  # ended (told with its end) or given up meanwhile
            return
        told = 0
        while told < len(unsent) and unsent[told].seq <= seq:
            told += 1
        sent = unsent[:told]
        del unsent[:told]
        if unsent:  # appended after that row was serialised (PostgreSQL): the next write tells them
            self._saver.then(task, partial(self._saved_to, task, unsent))
        else:
            self._unsent.pop(task.id, None)
        for event in sent:  # called by the store's writer: one that fails must not stop the others' callbacks
            try:
                self._relay(task, event)
            except Exception:
                logger.exception("task %s: could not tell event %d", task.id, event.seq)

    def _relay(self, task: Task, event: TaskEvent) -> None:
        """Tell `event` to the task's followers here, on the other nodes, and to the notifier (webhooks, inbox)."""
        if self._peers is not None:  # followers on the other nodes of a cluster
            self._peers.event(task.id, event)
        self.feed(task.id, event)
        if self.notifier is not None:
            tell(self.notifier, self.registry, task, event)


# events streamed as they come (a step's output, the LLM's tokens, progress, each device's outcome of a step `on:
# all` as it arrives, which its `step_finished` holds whole): told at once, saved with the next event that is
# saved; every other event is told only once saved (`Running._on_event`)
STREAMED = frozenset({"output", "token", "planning_progress", "progress", "fanout_device"})


def task_asker(task: Task) -> TokenRef | None:
    """The token `task` acts for, as the hub's batches carry their caller (None: the task recorded none)."""
    return TokenRef(task.asker.name, task.asker.agent, task.asker.sample) if task.asker is not None else None

