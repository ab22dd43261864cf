"""The executor (seed 004's executeCommand and the adaptive loop): plan, run one step per pass, recover.

    runner = TaskRunner(lambda device: dispatcher, llm, tools={None: tools}, ask=ask_person)
    task = await runner.run(Task(request="...", plan=plan))

Each step goes through the dispatcher of its device (`dispatchers(step.device)`), local or remote,
as `Command(tool_name=step.skill, parameters=step.args)`. A success advances the cursor; a failure
goes to recovery (fast path, LLM, ASK_USER) and the decision is applied: AUTO_PATCH retries the step
with the patched arguments, REPLAN plans the rest again from the cursor, ASK_USER waits for `ask` and
maps the answer. Budgets (patches per step, re-plans per task, commands per task, wall time) end in
ASK_USER or failure, never a loop. Everything that happens is a `TaskEvent` on the task and, when
`on_event` is given, passed to it as it happens (streamed command output included).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol, runtime_checkable

from tether.agent.llm.chat import LLMClient, LLMError
from tether.agent.llm.settings import how_to_configure
from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.graph import is_graph, step_ids
from tether.agent.planning.plan import OBSERVE, Plan, validate_plan
from tether.agent.planning.planner import DEFAULT_POLICY_SUMMARY, PlanningError, plan_request
from tether.agent.planning.refs import ERROR_CODE as REF_ERROR_CODE
from tether.agent.planning.refs import RefError, has_refs, resolve
from tether.agent.run.answer import format_answer
from tether.agent.run.confirm import CONFIRMATION
from tether.agent.run.decisions import (
    AskUser,
)
from tether.agent.run.graph import Chooser, GraphRun
from tether.agent.run.observe import step_results
from tether.agent.run.recovery import tool_for
from tether.agent.run.resolving import Resolving
from tether.agent.run.rounds import Rounds, _PlanFailed
from tether.agent.run.steps import fan_out_step, history_row, short
from tether.agent.run.task import Budgets, StepRecord, Task, TaskEvent, TaskState
from tether.errors import AgentError
from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.models import Command, Result, ToolInfo
from tether.protocol.profile import DeviceProfile

DEFAULT_DEVICE_NAME = "local"


class _Stop(AgentError):
    """The task reached a terminal state; unwinds the loop."""


class TaskRunner(Rounds, Resolving):
    def __init__(self, dispatchers: Callable[[str | None], BasicCommandDispatcher], llm: LLMClient | None, *,
                 tools: Mapping[str | None, list[ToolInfo]], ask: Callable[[AskUser], Awaitable[str]],
                 on_event: Callable[[TaskEvent], None] | None = None, budgets: Budgets | None = None,
                 policy_summary: str = DEFAULT_POLICY_SUMMARY, command_timeout: float = 600.0,
                 stream_answer: bool = True, stream_planning: bool = False, clock: Callable[[], float] = time.monotonic,
                 default_device: str = DEFAULT_DEVICE_NAME, profiles: Mapping[str, DeviceProfile] | None = None,
                 choose: Chooser | None = None) -> None:
        self.dispatchers = dispatchers
        self.choose = choose  # a graph step's `requires` → (device, why); None: no fleet to choose from
        self.default_device = default_device
        self.profiles = dict(profiles or {})  # by device name: what the planner tells the LLM about each
        # Set by whoever stops the runner for a reason that is not the user's (a server shutting
        # down): the task keeps its state, so it can be resumed, instead of becoming cancelled.
        self.interrupted = False
        self.graph: GraphRun | None = None  # the graph being run now, which edits from outside go to
        self.llm = llm
        self.tools = dict(tools)
        self.ask = ask
        self.on_event = on_event
        self.budgets = budgets or Budgets()
        self.policy_summary = policy_summary
        self.command_timeout = command_timeout
        self.stream_answer = stream_answer
        self.stream_planning = stream_planning  # stream the planner's reply to count its tokens for a display
        self.clock = clock
        self._started = 0.0
        self._waited = 0.0  # time spent waiting for a person does not count against the wall-time budget
        self._elapsed_before = 0.0

    # -- events and state ---------------------------------------------------------------------------

    def _emit(self, task: Task, kind: str, data: dict[str, Any] | None = None) -> TaskEvent:
        event = task.record(kind, data)
        self._publish(event)
        return event

    def _publish(self, event: TaskEvent | None) -> None:
        if event is not None and self.on_event is not None:
            self.on_event(event)

    def _to(self, task: Task, state: TaskState, **data: Any) -> None:
        self._publish(task.transition(state, **data))

    def _end(self, task: Task, state: TaskState, error: str | None = None) -> None:
        task.error = error
        self._to(task, state, **({"error": error} if error else {}))
        raise _Stop

    def _elapsed(self) -> float:
        return self._elapsed_before + (self.clock() - self._started) - self._waited

    # -- the loop -------------------------------------------------------------------------------------

    async def run(self, task: Task) -> Task:
        """Run `task` until it is done, failed or cancelled (resuming where it stopped)."""
        if task.state.terminal:
            return task
        self._started = self.clock()
        self._waited = 0.0
        self._elapsed_before = task.counters.elapsed_s
        llm_before = self._llm_counts()
        try:
            await self._run(task)
        except _Stop:
            pass
        except asyncio.CancelledError:
            if self.interrupted:
                self._emit(task, "interrupted", {"state": task.state.value, "step": task.cursor})
            elif not task.state.terminal:
                task.error = "cancelled"
                self._publish(task.transition(TaskState.CANCELLED, error="cancelled"))
            raise
        finally:
            task.counters.elapsed_s = self._elapsed()
            self._count_llm(task, llm_before)
        return task

    async def _run(self, task: Task) -> None:
        graph = task.plan is not None and is_graph(task.plan.steps)
        if task.state is TaskState.CREATED:
            if task.plan is None or not task.plan.steps:
                if self.llm is None:
                    self._end(task, TaskState.FAILED, how_to_configure())
                await self._plan(task, recovery_context=None, replace_from=0)
            else:
                problems = validate_plan(task.plan, self.tools) if self.tools else []
                if problems:
                    self._end(task, TaskState.FAILED, "the plan has problems:\n"
                              + "\n".join(f"- {p}" for p in problems))
                self._emit(task, "plan", {"steps": [s.model_dump(mode="json") for s in task.plan.steps],
                                          "source": "given"})
                await self._confirm(task, 0)
            self._to(task, TaskState.RUNNING)
        elif task.state is TaskState.PLANNING:
            await self._plan(task, recovery_context=None, replace_from=task.cursor)
            self._to(task, TaskState.RUNNING)
        elif (task.state is TaskState.WAITING_FOR_USER and task.pending_question is not None
              and task.pending_question.kind == CONFIRMATION):
            await self._confirm(task, task.pending_question.step or 0, existing=task.pending_question)
            self._to(task, TaskState.RUNNING)
        elif graph:  # each branch takes up its own state (`GraphRun`)
            pass
        elif task.state is TaskState.WAITING_FOR_USER and task.pending_question is not None:
            pending = task.pending_question
            await self._resolve(task, AskUser(question=pending.question, options=pending.options,
                                              kind="approval" if pending.kind == "approval" else "question",
                                              changes=pending.changes, digest=pending.digest, source="user"),
                                existing=pending)
        elif task.state in (TaskState.RECOVERING, TaskState.WAITING_FOR_USER):
            self._to(task, TaskState.RUNNING)
        assert task.plan is not None
        while task.cursor < len(task.plan.steps):
            if is_graph(task.plan.steps):  # given, planned, or a re-plan that made the rest a graph
                self.graph = GraphRun(self, task, self.choose)
                try:
                    await self.graph.run()
                finally:
                    self.graph = None
                break
            self._check_budgets(task)
            if task.plan.steps[task.cursor].skill == OBSERVE:
                await self._observe(task)
                continue
            result = await self._execute(task)
            if result.ok:
                task.cursor += 1
                continue
            self._to(task, TaskState.RECOVERING, step=task.cursor)
            decision = await self._decide(task, result)
            await self._resolve(task, decision)
        await self._finish(task)

    def _check_budgets(self, task: Task) -> None:
        if task.counters.commands >= self.budgets.total_steps:
            self._end(task, TaskState.FAILED, f"the task used its budget of {self.budgets.total_steps} commands "
                                              f"before finishing (step {task.cursor + 1} was next)")
        if self._elapsed() > self.budgets.wall_time_s:
            self._end(task, TaskState.FAILED, f"the task ran out of its wall-time budget of "
                                              f"{self.budgets.wall_time_s:g} s (step {task.cursor + 1} was next)")

    async def _execute(self, task: Task) -> Result:
        assert task.plan is not None
        index = task.cursor
        step = task.plan.steps[index]
        approved = (task.approved_by or "user") if task.approved_step == index else None
        digest = task.approved_digest if approved else None
        task.approved_step = task.approved_by = task.approved_digest = None
        unresolved: str | None = None
        params = dict(step.args)
        if has_refs(step.args):
            try:
                params = resolve(step.args, step_results(task), ids=step_ids(task.plan.steps))
            except RefError as exc:
                unresolved = str(exc)
        command = Command(tool_name=step.skill, parameters=params, approved_by=approved, approval_digest=digest)
        attempt = len(task.records_for(index)) + 1
        task.counters.tried_args.setdefault(str(index), []).append(dict(step.args))
        self._emit(task, "step_started", {"step": index, "attempt": attempt, "skill": step.skill,
                                          "args": step.args, "device": step.device,
                                          "description": step.description, "call_id": command.call_id,
                                          "approved_by": approved})
        started = datetime.now(UTC)
        if unresolved is not None:  # nothing is sent: recovery re-plans from what the steps really returned
            result = Result.failure(unresolved, command.call_id,
                                    result={"error_code": REF_ERROR_CODE})
            return self._record(task, index, attempt, step, command, result, started)
        task.counters.commands += 1
        dispatcher = self.dispatchers(step.device)
        hook = (dispatcher, dispatcher.emit) if isinstance(dispatcher, _Streams) else None
        if hook is not None:

            def stream(kind: str, data: dict[str, Any]) -> None:
                self._emit(task, kind, {"step": index, **data})

            hook[0].emit = stream
        timeout = max(1.0, min(self.command_timeout, self.budgets.wall_time_s - self._elapsed()))
        try:
            if step.on == "all":
                results = [await fan_out_step(dispatcher, command, step.requires, timeout)]
            else:
                results = await dispatcher.execute_commands([command], timeout=timeout)
        except Exception as exc:  # a dispatcher should not raise, but a broken one must not kill the task
            results = dispatcher.generate_error_results([command], exc)
        finally:
            if hook is not None:
                hook[0].emit = hook[1]
        result = results[0] if results else Result.failure("the device returned no result", command.call_id)
        return self._record(task, index, attempt, step, command, result, started)

    def _record(self, task: Task, index: int, attempt: int, step: Any, command: Command, result: Result,
                started: datetime) -> Result:
        task.steps.append(StepRecord(index=index, attempt=attempt, step=step, command=command, result=result,
                                     started_at=started))
        self._emit(task, "step_finished", {"step": index, "attempt": attempt, "status": result.status.value,
                                           "error": result.error, "result": short(result.result)})
        return result

    # -- planning -------------------------------------------------------------------------------------

    def _devices(self) -> dict[str, DeviceView]:
        """The devices the planner may use, by name; the default device (key None) under its own name."""
        views: dict[str, DeviceView] = {}
        for name, tools in self.tools.items():
            if name is None and self.default_device in self.tools:
                continue
            label = self.default_device if name is None else name
            views[label] = DeviceView(tools=list(tools), profile=self.profiles.get(label))
        return views

    async def _plan(self, task: Task, *, recovery_context: str | None, replace_from: int,
                    observing: bool = False) -> None:
        if self.llm is None:
            raise _PlanFailed("no LLM is configured")
        self._to(task, TaskState.PLANNING)
        self._emit(task, "planning", {"from_step": replace_from, "recovery_context": recovery_context,
                                      **({"observing": True} if observing else {})})
        earlier = [tool_for(s, self.tools) if s.skill != OBSERVE else None
                   for s in (task.plan.steps[:replace_from] if task.plan is not None else [])]
        try:
            planned = await plan_request(self.llm, task.request, devices=self._devices(),
                                         policy_summary=self.policy_summary,
                                         history=[] if observing else [history_row(r) for r in task.steps],
                                         recovery_context=recovery_context, earlier=earlier,
                                         allow_empty=observing, stream=self.stream_planning,
                                         on_token=self._planning_token(task) if self.stream_planning else None)
        except (PlanningError, LLMError) as exc:
            if replace_from == 0 and task.plan is None:
                self._end(task, TaskState.FAILED, f"planning failed: {exc}")
            raise _PlanFailed(str(exc)) from None
        steps = [self._own_device(s) for s in planned.plan.steps]
        for counts in (task.counters.patches, task.counters.tried_args):
            for key in [k for k in counts if int(k) >= replace_from]:
                del counts[key]
        kept = task.plan.steps[:replace_from] if task.plan is not None else []
        task.plan = Plan(steps=[*kept, *steps], answer=planned.plan.answer)
        source = "observe" if observing else "llm" if not recovery_context else "replan"
        self._emit(task, "plan", {"steps": [s.model_dump(mode="json") for s in steps], "from_step": replace_from,
                                  "source": source})
        await self._confirm(task, replace_from)

    def _own_device(self, step: Any) -> Any:
        if step.device == self.default_device and None in self.tools:
            return step.model_copy(update={"device": None})
        return step

    # -- the end --------------------------------------------------------------------------------------

    async def _finish(self, task: Task) -> None:
        def token(piece: str) -> None:
            self._emit(task, "token", {"text": piece})

        planned = task.plan.answer if task.plan is not None else None
        if planned and not task.questions and all(r.result.ok for r in task.steps):
            # the planner said what to reply once every step succeeds, and every step did at once
            if self.stream_answer:
                token(planned)
            task.answer = planned
        else:
            task.answer = await format_answer(task, self.llm, on_token=token if self.stream_answer else None)
        self._emit(task, "answer", {"text": task.answer})
        self._to(task, TaskState.DONE)

    def _llm_counts(self) -> tuple[int, int, int]:
        if self.llm is None:
            return (0, 0, 0)
        return (self.llm.calls, self.llm.prompt_tokens, self.llm.completion_tokens)

    def _count_llm(self, task: Task, before: tuple[int, int, int]) -> None:
        after = self._llm_counts()
        task.counters.llm_calls += after[0] - before[0]
        task.counters.prompt_tokens += after[1] - before[1]
        task.counters.completion_tokens += after[2] - before[2]


@runtime_checkable
class _Streams(Protocol):
    """A dispatcher that streams a command's events to its `emit` hook while the command runs."""

    emit: Callable[[str, dict[str, Any]], None] | None
