"""Running a graph plan: the steps whose needs have ended start at once, each branch recovering on its own.

`GraphRun(runner, task).run()` drives a task whose plan is a graph (`tether.agent.planning.graph`) for
the `TaskRunner` (which plans, confirms and answers around it). It keeps each step's state in
`task.step_states` (saved with the task, so a restarted server goes on without re-running a finished
step) and:

- starts every pending step whose needs have all ended and whose `when` holds (else it is `skipped`,
  with the reason as a `step_skipped` event), at most `budgets.parallel_steps` at once and one at a time
  per device (in plan order: a device's session runs its steps in the order the plan lists them);
- chooses the device of a step that gives `requires` instead of a device (`choose`), and records the
  choice and why as a `device_chosen` event;
- on a failure that a dependant handles (`when: failure | always`, or a condition) marks the step
  `failed` and goes on; otherwise recovers that branch alone while the others run: AUTO_PATCH retries it,
  REPLAN re-plans the branch (a live edit replacing the step), ASK_USER asks a person (one question at a
  time; skip marks the step `skipped`, and its dependants are skipped unless `when` says otherwise);
- at `observe`, re-plans the branch from what its steps found (a live edit, see `planning/edits.py`):
  every edit is an `edit` event, or an `edit_refused` event with the reasons;
- stops every running branch when the task is cancelled or ends.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tether.agent.llm.chat import LLMError
from tether.agent.planning.edits import GONE, REMOVED, EditRefused, apply_edit, replacement
from tether.agent.planning.graph import ancestors, dependants, dependencies, label, step_ids
from tether.agent.planning.plan import OBSERVE, Plan
from tether.agent.planning.planner import PlanningError, plan_request
from tether.agent.planning.refs import ERROR_CODE as REF_ERROR_CODE
from tether.agent.planning.refs import RefError, has_refs, resolve
from tether.agent.run.observe import step_row
from tether.agent.run.recovery import (
    OPTION_APPROVE,
    OPTION_CANCEL,
    OPTION_DENY,
    OPTION_RETRY,
    OPTION_SKIP,
    AskUser,
    AutoPatch,
    RecoveryInput,
    Replan,
    apply_budgets,
    fallback,
    recover,
    tool_for,
)
from tether.agent.run.steps import fan_out_step, history_row, match_option, short
from tether.agent.run.task import Question, StepRecord, Task, TaskState
from tether.errors import AgentError
from tether.protocol.models import Command, Result
from tether.protocol.profile import DeviceRequirements

PENDING, RUNNING, DONE, FAILED, SKIPPED, REPLACED = "pending", "running", "done", "failed", "skipped", "replaced"
ENDED = frozenset({DONE, FAILED, SKIPPED, REPLACED, REMOVED})
RESTART_UNKNOWN = "restart_unknown"  # a step in flight whose outcome the restarted server could not learn

Chooser = Callable[[DeviceRequirements], tuple[str, str]]


class NoDeviceFits(AgentError, LookupError):
    """No device meets a step's `requires`; the message says why each one does not."""


class GraphRun:
    """One run of a graph task by its `TaskRunner`; see the module docstring."""

    def __init__(self, runner: Any, task: Task, choose: Chooser | None = None) -> None:
        """`runner`: the `TaskRunner` (executor.py, which imports this module) whose events, states, budgets,
        dispatchers, planner and person this run uses; `choose`: a `requires` → (device, why)."""
        self.runner = runner
        self.task = task
        self.choose = choose
        self.jobs: dict[int, asyncio.Task[None]] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.asking = asyncio.Lock()

    # -- the graph --------------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        assert self.task.plan is not None
        return self.task.plan

    @property
    def states(self) -> list[str]:
        states = self.task.step_states
        if len(states) < len(self.plan.steps):
            states += [PENDING] * (len(self.plan.steps) - len(states))
        return states

    def _dropped(self) -> set[int]:
        return {i for i, s in enumerate(self.states) if s in GONE}

    def _deps(self) -> list[list[int]]:
        return dependencies(self.plan.steps, self._dropped())

    def _ids(self) -> dict[str, int]:
        return step_ids(self.plan.steps, self._dropped())

    def _set(self, index: int, state: str, **data: Any) -> None:
        self.states[index] = state
        self.runner._emit(self.task, "step_state", {"step": index, "state": state, **data})

    def results(self) -> dict[int, Any]:
        """What references read: each finished step's (numbered from 1) result from its last attempt."""
        out: dict[int, Any] = {}
        for record in self.task.steps:
            if self.states[record.index] == DONE and record.result.ok:
                out[record.index + 1] = record.result.result
        return out

    # -- the loop ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run every step to an end (or until the task ends: `_Stop` and cancellation propagate)."""
        self._take_up()
        try:
            while True:
                self._schedule()
                if not self.jobs:
                    break
                done, _ = await asyncio.wait(self.jobs.values(), return_when=asyncio.FIRST_COMPLETED)
                for index in [i for i, job in self.jobs.items() if job in done]:
                    job = self.jobs.pop(index)
                    if job.exception() is not None:
                        raise job.exception()  # type: ignore[misc]
        finally:
            for job in self.jobs.values():
                job.cancel()
            await asyncio.gather(*self.jobs.values(), return_exceptions=True)
            self.jobs.clear()

    def _take_up(self) -> None:
        """A task that ran before (resumed, or a list plan that became a graph by a re-plan): steps before the
        cursor of a list run have ended; a step left running resumes from its last record."""
        task = self.task
        if not task.step_states:
            last = {r.index: r for r in task.steps}
            task.step_states = [(DONE if i in last and last[i].result.ok else SKIPPED) if i < task.cursor else PENDING
                                for i in range(len(self.plan.steps))]
        pending = task.pending_question
        for index, state in enumerate(self.states):
            if state != RUNNING:
                continue
            asked = pending if pending is not None and pending.step == index else None
            self.jobs[index] = asyncio.create_task(self._branch(index, resume=True, question=asked),
                                                   name=f"task {task.id} step {index + 1}")

    def _schedule(self) -> None:
        changed = True
        while changed:
            changed = False
            deps = self._deps()
            for index, state in enumerate(self.states):
                if state != PENDING or index in self.jobs or not all(self.states[d] in ENDED for d in deps[index]):
                    continue
                run, why = self._should_run(index, deps)
                if not run:
                    self._set(index, SKIPPED, reason=why)
                    changed = True
                    continue
                if len(self.jobs) >= self.runner.budgets.parallel_steps:
                    return
                self._set(index, RUNNING)
                self.jobs[index] = asyncio.create_task(self._branch(index),
                                                       name=f"task {self.task.id} step {index + 1}")

    def _should_run(self, index: int, deps: list[list[int]]) -> tuple[bool, str]:
        step = self.plan.steps[index]
        ended = {d: self.states[d] for d in deps[index]}
        failed = [d for d, s in ended.items() if s in (FAILED, SKIPPED)]
        if step.when == "always":
            return True, ""
        if step.when == "failure":
            return (bool(failed), "" if failed else "it runs only when a step it needs fails, and none did")
        if failed:
            names = ", ".join(label(self.plan.steps, d) + f" {ended[d]}" for d in failed)
            return False, f"{names}"
        if isinstance(step.when, str):
            return True, ""
        holds, why = step.when.holds(self.results(), self._ids())
        return holds, why

    def _handled(self, index: int) -> bool:
        """Whether a step's failure is part of the plan: a dependant runs on failure (or always)."""
        return any(self.plan.steps[d].when in ("failure", "always") for d in dependants(self._deps(), index))

    # -- a branch ---------------------------------------------------------------------------------------

    def _device(self, index: int) -> str | None:
        step = self.plan.steps[index]
        return step.device or self.task.step_devices.get(str(index))

    async def _branch(self, index: int, *, resume: bool = False, question: Question | None = None) -> None:
        step = self.plan.steps[index]
        if step.device is None and step.requires is not None and step.on != "all" \
                and str(index) not in self.task.step_devices:
            self._choose(index, step.requires)
        key = self._device(index) or ""
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            if resume:
                if question is not None:
                    if not await self._after(index, await self._ask(index, None, existing=question)):
                        return
                else:
                    last = [r for r in self.task.steps if r.index == index]
                    if last and last[-1].result.ok:
                        self._set(index, DONE)
                        return
                    if last and not await self._failed(index, last[-1].result):
                        return
            while True:
                self.runner._check_budgets(self.task)
                if self.plan.steps[index].skill == OBSERVE:
                    await self._observe(index)
                    return
                result = await self._execute(index)
                if result.ok:
                    self._set(index, DONE)
                    return
                if not await self._failed(index, result):
                    return

    def _choose(self, index: int, requires: DeviceRequirements) -> None:
        if self.choose is None:
            raise NoDeviceFits("this task runs on one device: a step's requires needs an agent server's devices")
        try:
            name, why = self.choose(requires)
        except LookupError as exc:
            self.runner._end(self.task, TaskState.FAILED, f"{label(self.plan.steps, index)}: {exc}")
            raise  # not reached: _end raises
        self.task.step_devices[str(index)] = name
        if name not in self.runner.tools:
            self.runner.tools[name] = self.runner.tools.get(None, [])
        self.runner._emit(self.task, "device_chosen", {"step": index, "device": name, "why": why,
                                                       "requires": requires.model_dump(exclude_defaults=True)})

    async def _failed(self, index: int, result: Result) -> bool:
        """Deal with a failed attempt of step `index`; True to run it again."""
        if self._handled(index):
            self._set(index, FAILED, error=result.error)
            return False
        if isinstance(result.result, dict) and result.result.get("error_code") == RESTART_UNKNOWN:
            decision: AutoPatch | Replan | AskUser = AskUser(
                question=f"{label(self.plan.steps, index)}: {result.error}. Retry it, skip it, or cancel the task?",
                options=[OPTION_RETRY, OPTION_SKIP, OPTION_CANCEL], reason="restart", source="fast_path")
        else:
            decision = await self._decide(index, result)
        while True:
            if isinstance(decision, AutoPatch):
                key = str(index)
                self.task.counters.patches[key] = self.task.counters.patches.get(key, 0) + 1
                self.plan.steps[index] = self.plan.steps[index].model_copy(update={"args": dict(decision.patched_args)})
                self.runner._emit(self.task, "patched", {"step": index, "args": decision.patched_args,
                                                         "note": decision.note})
                return True
            if isinstance(decision, Replan):
                checked = apply_budgets(decision, self._input(index, result), self.runner.budgets)
                if isinstance(checked, Replan):
                    self.task.counters.replans += 1
                    try:
                        await self._replace(index, self._replan_context(index, result, checked), observing=False)
                    except _EditFailed as exc:
                        decision = fallback(self._input(index, result), f"Re-planning the branch failed ({exc}).")
                        continue
                    self._set(index, REPLACED)
                    return False
                decision = checked
                continue
            answered = await self._ask(index, decision)
            if isinstance(answered, bool):
                return answered
            decision = answered

    async def _after(self, index: int, answered: bool | AutoPatch | Replan | AskUser) -> bool:
        """Where a resumed question's answer leads: True to run the step again."""
        while not isinstance(answered, bool):
            if isinstance(answered, AskUser):
                answered = await self._ask(index, answered)
            else:
                result = next((r.result for r in reversed(self.task.steps) if r.index == index),
                              Result.failure("no attempt recorded"))
                return await self._failed_with(index, result, answered)
        return answered

    async def _failed_with(self, index: int, result: Result, decision: AutoPatch | Replan) -> bool:
        if isinstance(decision, AutoPatch):
            self.plan.steps[index] = self.plan.steps[index].model_copy(update={"args": dict(decision.patched_args)})
            return True
        try:
            await self._replace(index, self._replan_context(index, result, decision), observing=False)
        except _EditFailed as exc:
            return await self._after(index, fallback(self._input(index, result), f"Re-planning failed ({exc})."))
        self._set(index, REPLACED)
        return False

    # -- one attempt ------------------------------------------------------------------------------------

    async def _execute(self, index: int) -> Result:
        runner, task = self.runner, self.task
        step = self.plan.steps[index]
        device = self._device(index)
        approved = (task.approved_by or "user") if task.approved_step == index else None
        digest = task.approved_digest if approved else None
        if approved:
            task.approved_step = task.approved_by = task.approved_digest = None
        unresolved: str | None = None
        params = dict(step.args)
        if has_refs(step.args):
            try:
                params = resolve(step.args, self.results(), ids=self._ids())
            except RefError as exc:
                unresolved = str(exc)
        command = Command(tool_name=step.skill, parameters=params, approved_by=approved, approval_digest=digest)
        attempt = len(task.records_for(index)) + 1
        task.counters.tried_args.setdefault(str(index), []).append(dict(step.args))
        runner._emit(task, "step_started", {"step": index, "attempt": attempt, "skill": step.skill, "args": step.args,
                                            "device": device, "description": step.description,
                                            "call_id": command.call_id, "approved_by": approved})
        started = datetime.now(UTC)
        ran = step if device == step.device else step.model_copy(update={"device": device})
        if unresolved is not None:
            result = Result.failure(unresolved, command.call_id, result={"error_code": REF_ERROR_CODE})
        else:
            task.counters.commands += 1
            result = await self._send(index, device, command)
        task.steps.append(StepRecord(index=index, attempt=attempt, step=ran, command=command, result=result,
                                     started_at=started))
        runner._emit(task, "step_finished", {"step": index, "attempt": attempt, "status": result.status.value,
                                             "error": result.error, "result": short(result.result),
                                             "device": device})
        return result

    async def _send(self, index: int, device: str | None, command: Command) -> Result:
        runner, task = self.runner, self.task
        step = self.plan.steps[index]
        dispatcher = runner.dispatchers(device)
        emit = getattr(dispatcher, "emit", False)
        if emit is not False:
            def stream(kind: str, data: dict[str, Any]) -> None:
                runner._emit(task, kind, {"step": index, **data})

            dispatcher.emit = stream
        timeout = max(1.0, min(runner.command_timeout, runner.budgets.wall_time_s - runner._elapsed()))
        try:
            if step.on == "all":
                results = [await fan_out_step(dispatcher, command, step.requires, timeout)]
            else:
                results = await dispatcher.execute_commands([command], timeout=timeout)
        except Exception as exc:  # a broken dispatcher must not kill the task
            results = dispatcher.generate_error_results([command], exc)
        finally:
            if emit is not False:
                dispatcher.emit = emit
        return results[0] if results else Result.failure("the device returned no result", command.call_id)

    # -- recovery ---------------------------------------------------------------------------------------

    def _input(self, index: int, result: Result) -> RecoveryInput:
        step = self.plan.steps[index]
        tried = self.task.counters.tried_args.get(str(index), [])
        return RecoveryInput(request=self.task.request, step=step, index=index, result=result,
                             tool=tool_for(step, self.runner.tools),
                             patches_used=self.task.counters.patches.get(str(index), 0), tried_args=tried[:-1],
                             replans_used=self.task.counters.replans,
                             history=[history_row(r) for r in self.task.steps],
                             can_replan=self.runner.llm is not None)

    async def _decide(self, index: int, result: Result) -> AutoPatch | Replan | AskUser:
        decision = await recover(self._input(index, result), self.runner.llm, self.runner.budgets)
        record = next(r for r in reversed(self.task.steps) if r.index == index)
        record.decision = decision.model_dump(mode="json")
        self.runner._emit(self.task, "decision", {"step": index, **decision.model_dump(mode="json")})
        return decision

    async def _ask(self, index: int, question: AskUser | None, existing: Question | None = None
                   ) -> bool | AutoPatch | Replan | AskUser:
        """Ask a person about step `index` (one question of the task at a time; the other branches go on).
        True: run the step again; False: the step ended (skipped); or the next decision."""
        runner, task = self.runner, self.task
        async with self.asking:
            record = existing
            if record is None:
                assert question is not None
                record = Question(step=index, question=question.question, options=list(question.options),
                                  kind=question.kind, changes=list(question.changes), digest=question.digest)
                task.questions.append(record)
            else:
                question = AskUser(question=record.question, options=record.options,
                                   kind="approval" if record.kind == "approval" else "question",
                                   changes=record.changes, digest=record.digest, source="user")
            runner._to(task, TaskState.WAITING_FOR_USER, question=record.id)
            if existing is None:
                runner._emit(task, "question", record.model_dump(mode="json"))
            asked = runner.clock()
            try:
                raw = await runner.ask(question)
            finally:
                runner._waited += runner.clock() - asked
            answer = (raw or "").strip()
            record.answer = answer
            record.answered_at = datetime.now(UTC)
            runner._emit(task, "user_answer", {"question": record.id, "answer": answer})
            choice = match_option(answer, question.options)
            if choice == OPTION_DENY:
                runner._end(task, TaskState.CANCELLED, f"{label(self.plan.steps, index)} was not approved: "
                                                       f"{question.question}")
            if choice == OPTION_CANCEL or answer.lower() == OPTION_CANCEL or (not answer
                                                                            and OPTION_CANCEL in question.options):
                runner._end(task, TaskState.CANCELLED, "cancelled by the user")
            runner._to(task, TaskState.RUNNING)
        if choice == OPTION_APPROVE:
            task.approved_step, task.approved_by, task.approved_digest = index, record.answered_by, record.digest
            return True
        if choice == OPTION_RETRY:
            return True
        if choice == OPTION_SKIP:
            runner._emit(task, "skipped", {"step": index})
            self._set(index, SKIPPED, reason="skipped by the user")
            return False
        if not answer:
            return AskUser(question=question.question, options=question.options, kind=question.kind,
                           changes=question.changes, digest=question.digest, reason="the answer was empty",
                           source="user")
        chosen = choice or answer
        return Replan(suggestion=chosen, constraint=chosen, source="user")

    # -- live re-planning -------------------------------------------------------------------------------

    def _graph_lines(self) -> list[str]:
        deps = self._deps()
        lines = ["The plan is a graph; its steps now (number, id, state, needs):"]
        for i, step in enumerate(self.plan.steps):
            if self.states[i] in GONE:
                continue
            needs = ", ".join(self.plan.steps[d].id or str(d + 1) for d in deps[i]) or "-"
            device = self._device(i) or self.runner.default_device
            lines.append(f"  {i + 1}. id={step.id or '-'} {step.skill} on {device}: {self.states[i]}; needs {needs}")
        return lines

    def _replan_context(self, index: int, result: Result, replan: Replan) -> str:
        step = self.plan.steps[index]
        lines = [f"{label(self.plan.steps, index)} ({step.skill} {json.dumps(step.args, default=str)}) failed: "
                 f"{result.error}"]
        if replan.suggestion:
            lines.append(f"Suggestion: {replan.suggestion}")
        if replan.constraint:
            lines.append(f"Constraint (from {'the user' if replan.source == 'user' else 'recovery'}): "
                         f"{replan.constraint}")
        if replan.alternative_cwd:
            lines.append(f"Use this working directory instead: {replan.alternative_cwd}")
        return "\n".join(lines)

    async def _observe(self, index: int) -> None:
        runner, task = self.runner, self.task
        note = str(self.plan.steps[index].args.get("note") or "")
        if task.counters.observe_rounds >= runner.budgets.observe_rounds_per_task:
            runner._end(task, TaskState.FAILED, f"the task used its budget of {runner.budgets.observe_rounds_per_task} "
                                                f"observation rounds before finishing ({label(self.plan.steps, index)} "
                                                "asked for another)")
        task.counters.observe_rounds += 1
        runner._emit(task, "observe", {"step": index, "round": task.counters.observe_rounds, "note": note})
        seen = ancestors(self._deps(), index)
        last = {r.index: r for r in task.steps if r.index in seen}
        lines = [f"Observation point at {label(self.plan.steps, index)}: the steps of its branch have run. Their "
                 "results:", *(step_row(last[i]) for i in sorted(last))]
        if note:
            lines.append(f"You wanted to look at: {note}")
        try:
            await self._replace(index, "\n".join(lines), observing=True)
        except _EditFailed as exc:
            runner._end(task, TaskState.FAILED, f"planning after the observation at {label(self.plan.steps, index)} "
                                                f"failed: {exc}")
        self._set(index, DONE)

    async def _replace(self, index: int, context: str, *, observing: bool) -> None:
        """Re-plan the branch at step `index`: the LLM's new part replaces the step, as one checked edit."""
        runner, task = self.runner, self.task
        if runner.llm is None:
            raise _EditFailed("no LLM is configured")
        lines = [context, "", *self._graph_lines(), "",
                 f"Plan only the steps that replace step {index + 1}; the other steps go on as they are. Give "
                 "every new step an id; a new step without needs follows the new step before it (the first one "
                 f"follows what step {index + 1} needed); needs and $ref may name the steps above by id or "
                 "number. A new step with the id of a pending step replaces it. Steps that needed step "
                 f"{index + 1} will need your last new steps instead."
                 + (' Answer {"steps": []} if nothing more is needed.' if observing else "")]
        runner._emit(task, "planning", {"from_step": index, "branch": True,
                                        **({"observing": True} if observing else {})})

        def check(part: Plan) -> list[str]:
            edit = replacement(self.plan, self.states, index, part.steps, replace=not observing)
            try:
                apply_edit(self.plan, self.states, edit, runner.tools)
            except EditRefused as exc:
                runner._emit(task, "edit_refused", {"step": index, "reasons": exc.problems, "edit": edit.summary()})
                return exc.problems
            return []

        try:
            planned = await plan_request(runner.llm, task.request, devices=runner._devices(),
                                         policy_summary=runner.policy_summary, recovery_context="\n".join(lines),
                                         allow_empty=observing, check=check)
        except (PlanningError, LLMError) as exc:
            raise _EditFailed(str(exc)) from None
        part = [runner._own_device(s) for s in planned.plan.steps]
        edit = replacement(self.plan, self.states, index, part, replace=not observing)
        try:
            new_plan, new_states = apply_edit(self.plan, self.states, edit, runner.tools)
        except EditRefused as exc:  # the graph moved on while the LLM answered
            runner._emit(task, "edit_refused", {"step": index, "reasons": exc.problems, "edit": edit.summary()})
            raise _EditFailed(str(exc)) from None
        task.plan = new_plan.model_copy(update={"answer": planned.plan.answer or self.plan.answer})
        task.step_states = new_states
        runner._emit(task, "edit", {"step": index, "source": "observe" if observing else "replan", **edit.summary()})


class _EditFailed(AgentError):
    pass
