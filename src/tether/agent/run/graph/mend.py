"""How a branch of a graph plan mends: recovery of a failed step (AUTO_PATCH, REPLAN, ASK_USER) for that
branch alone, and live re-planning (a branch's REPLAN, an `observe`) as one checked edit of the graph.

`GraphRun` (driver.py) inherits `Mending`; it uses the run's task, runner, graph and states.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tether.agent.llm.chat import LLMError
from tether.agent.planning.edits import EditRefused, apply_edit, replacement
from tether.agent.planning.graph import ancestors, label
from tether.agent.planning.plan import Plan
from tether.agent.planning.planner import PlanningError, plan_request
from tether.agent.run.confirm import (
    CONFIRMATION,
    OPTION_RUN,
    needs_confirmation,
    plan_digest,
    plan_text,
)
from tether.agent.run.decisions import (
    OPTION_APPROVE,
    OPTION_CANCEL,
    OPTION_DENY,
    OPTION_RETRY,
    OPTION_SKIP,
    AskUser,
    AutoPatch,
    RecoveryInput,
    Replan,
)
from tether.agent.run.graph.asking import ask_to_run
from tether.agent.run.graph.states import DONE, FAILED, GONE, REPLACED, RESTART_UNKNOWN, SKIPPED
from tether.agent.run.observe import step_row
from tether.agent.run.recovery import apply_budgets, fallback, recover, tool_for
from tether.agent.run.steps import history_row
from tether.agent.run.task import Question, Task, TaskState
from tether.errors import AgentError
from tether.protocol.models import Result


class Mending:
    """Mixed into `GraphRun`; see the module docstring."""

    # provided by GraphRun
    runner: Any
    task: Task
    asking: asyncio.Lock

    @property
    def plan(self) -> Plan:
        raise NotImplementedError  # GraphRun's

    @property
    def states(self) -> list[str]:
        raise NotImplementedError  # GraphRun's

    _set: Any
    _deps: Any
    _ids: Any
    _device: Any
    _handled: Any

    async def _failed(self, index: int, result: Result) -> bool:
        """Deal with a failed attempt of step `index`; True to run it again."""
        unknown = isinstance(result.result, dict) and result.result.get("error_code") == RESTART_UNKNOWN
        if self._handled(index) and not unknown:  # an unknown outcome may have succeeded: a person says which
            self._set(index, FAILED, error=result.error)
            return False
        if unknown:
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
            if existing is not None:  # asked before a restart: the same question again
                question = AskUser(question=existing.question, options=existing.options,
                                   kind="approval" if existing.kind == "approval" else "question",
                                   changes=existing.changes, digest=existing.digest, source="user")
            assert question is not None
            record, answer, choice = await runner._put(task, index, question, existing)
            if choice == OPTION_DENY:
                runner._end(task, TaskState.CANCELLED, f"{label(self.plan.steps, index)} was not approved: "
                                                       f"{question.question}")
            runner._end_if_cancelled(task, question, answer, choice)
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
        if part and needs_confirmation(task.confirm, part, runner.tools):  # nothing new runs unconfirmed
            await self._confirm_part(index, part)
        edit = replacement(self.plan, self.states, index, part, replace=not observing)
        try:
            new_plan, new_states = apply_edit(self.plan, self.states, edit, runner.tools)
        except EditRefused as exc:  # the graph moved on while the LLM answered
            runner._emit(task, "edit_refused", {"step": index, "reasons": exc.problems, "edit": edit.summary()})
            raise _EditFailed(str(exc)) from None
        task.plan = new_plan.model_copy(update={"answer": planned.plan.answer or self.plan.answer})
        task.step_states = new_states
        runner._emit(task, "edit", {"step": index, "source": "observe" if observing else "replan", **edit.summary()})


    async def _confirm_part(self, index: int, part: list[Any]) -> None:
        """A person confirms a branch's new steps before they join the graph, when the task's confirm mode
        says so (as a re-planned part of a list is confirmed); not confirming ends the task."""
        runner, task = self.runner, self.task
        first = len(self.plan.steps)
        async with self.asking:
            record = Question(step=first, kind=CONFIRMATION, options=[OPTION_RUN, OPTION_CANCEL],
                              question=f"Run these new steps (they replace {label(self.plan.steps, index)})?\n"
                                       + plan_text(part, first), digest=plan_digest(part, first))
            decided = await ask_to_run(runner, task, record)
            if not decided:
                runner._end(task, TaskState.CANCELLED, "the new steps were not confirmed")
            runner._to(task, TaskState.RUNNING)


class _EditFailed(AgentError):
    pass
