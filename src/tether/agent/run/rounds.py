"""The parts of the task runner around the step loop: a dry run, observation rounds (the planner shown
what the steps so far found, to plan the next part) and confirmation of each plan part by a person.

`TaskRunner` (executor.py) inherits them; they use its events, states and planner (`_emit`, `_to`,
`_end`, `_plan`, `ask`, `budgets`), kept apart so that the executor stays one screenful of loop.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tether.agent.llm.chat import LLMError
from tether.agent.llm.settings import how_to_configure
from tether.agent.planning.plan import Plan, validate_plan
from tether.agent.planning.planner import PlanningError, plan_request
from tether.agent.run.confirm import (
    CONFIRMATION,
    OPTION_RUN,
    confirmation_answer,
    needs_confirmation,
    plan_digest,
    plan_text,
)
from tether.agent.run.confirm import OPTION_CANCEL as CONFIRM_CANCEL
from tether.agent.run.decisions import AskUser
from tether.agent.run.observe import observation_context
from tether.agent.run.task import Question, Task, TaskState
from tether.errors import AgentError

CONFIRM_TRIES = 5  # answers that are neither run nor cancel before a confirmation gives up
PLANNING_PROGRESS_EVERY = 16  # streamed planner tokens per planning_progress event


class _PlanFailed(AgentError):
    pass


class Rounds:
    """Mixed into `TaskRunner`; see the module docstring."""

    # provided by TaskRunner
    llm: Any
    tools: Any
    budgets: Any
    ask: Any
    clock: Any
    policy_summary: str
    _waited: float
    _emit: Any
    _to: Any
    _end: Any
    _plan: Any
    _devices: Any
    _own_device: Any

    async def dry_run(self, task: Task) -> list[str]:
        """Plan the task (or check its given plan) and stop: nothing runs, nothing is asked. The plan is
        left on the task; the problems that would stop it are returned (empty when it would run)."""
        if task.plan is not None and task.plan.steps:
            return validate_plan(task.plan, self.tools) if self.tools else []
        if self.llm is None:
            return [how_to_configure()]
        try:
            planned = await plan_request(self.llm, task.request, devices=self._devices(),
                                         policy_summary=self.policy_summary)
        except (PlanningError, LLMError) as exc:
            return [f"planning failed: {exc}"]
        task.plan = Plan(steps=[self._own_device(s) for s in planned.plan.steps])
        return []

    async def _observe(self, task: Task) -> None:
        """An observation point: show the LLM what the steps so far returned and let it plan the rest."""
        assert task.plan is not None
        index = task.cursor
        note = str(task.plan.steps[index].args.get("note") or "")
        if task.counters.observe_rounds >= self.budgets.observe_rounds_per_task:
            self._end(task, TaskState.FAILED,
                      f"the task used its budget of {self.budgets.observe_rounds_per_task} observation rounds "
                      f"before finishing (step {index + 1} asked for another)")
        if self.llm is None:
            self._end(task, TaskState.FAILED, "the plan stops to observe at step "
                                              f"{index + 1}, which needs an LLM: " + how_to_configure())
        task.counters.observe_rounds += 1
        self._emit(task, "observe", {"step": index, "round": task.counters.observe_rounds, "note": note})
        context = observation_context(task, index, note)
        try:
            await self._plan(task, recovery_context=context, replace_from=index, observing=True)
        except _PlanFailed as exc:
            self._end(task, TaskState.FAILED, f"planning after the observation at step {index + 1} failed: {exc}")
        self._to(task, TaskState.RUNNING)

    async def _confirm(self, task: Task, first: int, existing: Question | None = None, *,
                       force: bool = False) -> None:
        """Ask a person to confirm the plan's steps from `first` on, when the task's mode says so (`force`:
        again, the plan having changed since it was confirmed)."""
        assert task.plan is not None
        steps = task.plan.steps[first:]
        if existing is None and not force and not needs_confirmation(task.confirm, steps, self.tools):
            return
        record = existing or Question(step=first, question="Run this plan?\n" + plan_text(steps, first),
                                      options=[OPTION_RUN, CONFIRM_CANCEL], kind=CONFIRMATION,
                                      digest=plan_digest(steps, first))
        if existing is None:
            task.questions.append(record)
            self._to(task, TaskState.WAITING_FOR_USER, question=record.id)
            self._emit(task, "question", record.model_dump(mode="json"))
        for _ in range(CONFIRM_TRIES):
            asked = self.clock()
            try:
                raw = await self.ask(AskUser(question=record.question, options=record.options,
                                             reason=CONFIRMATION, source="user"))
            finally:
                self._waited += self.clock() - asked
            answer = (raw or "").strip()
            decided = confirmation_answer(answer)
            if decided is None and answer:  # free words: neither run nor cancel
                self._emit(task, "user_answer", {"question": record.id, "answer": answer, "ignored": True})
            if decided is None:
                continue
            record.answer = answer
            record.answered_at = datetime.now(UTC)
            self._emit(task, "user_answer", {"question": record.id, "answer": answer})
            if not decided:
                self._end(task, TaskState.CANCELLED, "the plan was not confirmed")
            now = plan_digest(task.plan.steps[first:], first)
            if record.digest is not None and now != record.digest:  # not what was confirmed: ask again
                self._emit(task, "confirmation_void", {"question": record.id, "confirmed": record.digest,
                                                       "now": now})
                await self._confirm(task, first, None, force=True)
            return
        self._end(task, TaskState.CANCELLED, f"the plan was not confirmed: {CONFIRM_TRIES} answers were neither "
                                             f"{OPTION_RUN} nor {CONFIRM_CANCEL}")

    def _planning_token(self, task: Task) -> Callable[[str], None]:
        """Counts the planner's streamed tokens into sparse `planning_progress` events (a display's spinner
        shows them; one event per token would flood the task's log)."""
        count = 0

        def on_token(piece: str) -> None:
            nonlocal count
            count += 1
            if count % PLANNING_PROGRESS_EVERY == 0:
                self._emit(task, "planning_progress", {"tokens": count})

        return on_token

