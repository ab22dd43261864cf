"""Applying recovery's decisions in the task runner: AUTO_PATCH retries the step with the patched arguments,
REPLAN plans the rest again from the cursor, ASK_USER waits for the person's answer and maps it to what
happens next. Mixed into `TaskRunner` (`tether.agent.run.executor`).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

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
from tether.agent.run.recovery import apply_budgets, fallback, recover, tool_for
from tether.agent.run.rounds import _PlanFailed
from tether.agent.run.steps import history_row, match_option
from tether.agent.run.task import Question, Task, TaskState
from tether.protocol.models import Result

Decision = AutoPatch | Replan | AskUser


class Resolving:
    """Mixed into `TaskRunner`; see the module docstring."""

    # provided by TaskRunner
    llm: Any
    tools: Any
    budgets: Any
    ask: Any
    clock: Any
    _waited: float
    _emit: Any
    _to: Any
    _end: Any
    _plan: Any

    async def _decide(self, task: Task, result: Result) -> Decision:
        assert task.plan is not None
        index = task.cursor
        step = task.plan.steps[index]
        tried = task.counters.tried_args.get(str(index), [])
        inp = RecoveryInput(request=task.request, step=step, index=index, result=result,
                            tool=tool_for(step, self.tools), patches_used=task.counters.patches.get(str(index), 0),
                            tried_args=tried[:-1], replans_used=task.counters.replans,
                            history=[history_row(r) for r in task.steps], can_replan=self.llm is not None)
        decision = await recover(inp, self.llm, self.budgets)
        task.steps[-1].decision = decision.model_dump(mode="json")
        self._emit(task, "decision", {"step": index, **decision.model_dump(mode="json")})
        return decision

    async def _resolve(self, task: Task, decision: Decision, existing: Question | None = None) -> None:
        """Apply decisions until one lets the loop go on (or the task ends)."""
        current: Decision | None = decision
        while current is not None:
            if isinstance(current, AutoPatch):
                self._apply_patch(task, current)
                current = None
            elif isinstance(current, Replan):
                current = await self._apply_replan(task, current)
            else:
                current = await self._ask(task, current, existing)
                existing = None

    def _apply_patch(self, task: Task, patch: AutoPatch) -> None:
        assert task.plan is not None
        key = str(task.cursor)
        task.counters.patches[key] = task.counters.patches.get(key, 0) + 1
        step = task.plan.steps[task.cursor]
        task.plan.steps[task.cursor] = step.model_copy(update={"args": dict(patch.patched_args)})
        self._emit(task, "patched", {"step": task.cursor, "args": patch.patched_args, "note": patch.note})
        self._to(task, TaskState.RUNNING)

    async def _apply_replan(self, task: Task, replan: Replan) -> Decision | None:
        inp = self._input_for(task)
        checked = apply_budgets(replan, inp, self.budgets)
        if not isinstance(checked, Replan):
            return checked
        context_lines = []
        last = task.steps[-1] if task.steps else None
        if last is not None and not last.result.ok:
            context_lines.append(f"Step {last.index + 1} ({last.step.skill} {json.dumps(last.step.args, default=str)}) "
                                 f"failed: {last.result.error}")
        if replan.suggestion:
            context_lines.append(f"Suggestion: {replan.suggestion}")
        if replan.constraint:
            context_lines.append(f"Constraint (from {'the user' if replan.source == 'user' else 'recovery'}): "
                                 f"{replan.constraint}")
        if replan.alternative_cwd:
            context_lines.append(f"Use this working directory instead: {replan.alternative_cwd}")
        context_lines.append("Plan only the remaining work; the steps listed as already run succeeded or failed "
                             "as shown.")
        task.counters.replans += 1
        try:
            await self._plan(task, recovery_context="\n".join(context_lines), replace_from=task.cursor)
        except _PlanFailed as exc:
            return fallback(inp, f"Re-planning failed ({exc}).")
        self._to(task, TaskState.RUNNING)
        return None

    def _input_for(self, task: Task) -> RecoveryInput:
        assert task.plan is not None
        index = min(task.cursor, len(task.plan.steps) - 1)
        step = task.plan.steps[index]
        last = task.steps[-1].result if task.steps else Result.failure("no step has run yet")
        return RecoveryInput(request=task.request, step=step, index=index, result=last,
                             tool=tool_for(step, self.tools), patches_used=task.counters.patches.get(str(index), 0),
                             tried_args=task.counters.tried_args.get(str(index), []),
                             replans_used=task.counters.replans, can_replan=self.llm is not None)

    async def _put(self, task: Task, step: int, question: AskUser, existing: Question | None
                   ) -> tuple[Question, str, str | None]:
        """Put `question` about step `step` to a person (`existing`: the task's record of it, asked before a
        restart, so followers are not told of it twice) and record the answer: the task waits meanwhile.
        Returns the record, the answer (stripped; "" for none) and the option it matched, if any."""
        record = existing
        if record is None:
            record = Question(step=step, question=question.question, options=list(question.options),
                              kind=question.kind, changes=list(question.changes), digest=question.digest)
            task.questions.append(record)
        self._to(task, TaskState.WAITING_FOR_USER, question=record.id)
        if existing is None:  # a resumed task asked it before: followers must not be asked twice
            self._emit(task, "question", record.model_dump(mode="json"))
        asked = self.clock()
        try:
            raw = await self.ask(question)
        finally:
            self._waited += self.clock() - asked
        answer = (raw or "").strip()
        record.answer = answer
        record.answered_at = datetime.now(UTC)
        self._emit(task, "user_answer", {"question": record.id, "answer": answer})
        return record, answer, match_option(answer, question.options)

    def _end_if_cancelled(self, task: Task, question: AskUser, answer: str, choice: str | None) -> None:
        """End `task` as cancelled when the answer says cancel, whatever the options were (an approval offers
        approve/deny; a terminal that cannot be asked answers cancel): it must not become a re-plan constraint
        or a second question."""
        if choice == OPTION_CANCEL or answer.lower() == OPTION_CANCEL or (not answer
                                                                        and OPTION_CANCEL in question.options):
            self._end(task, TaskState.CANCELLED, "cancelled by the user")

    async def _ask(self, task: Task, question: AskUser, existing: Question | None) -> Decision | None:
        record, answer, choice = await self._put(task, task.cursor, question, existing)
        if choice == OPTION_APPROVE:
            task.approved_step = task.cursor
            task.approved_by = record.answered_by
            task.approved_digest = record.digest  # the device runs it only if it still shows this
            self._to(task, TaskState.RUNNING, approved=True)
            return None
        if choice == OPTION_DENY:
            self._end(task, TaskState.CANCELLED, f"step {task.cursor + 1} was not approved: {question.question}")
        self._end_if_cancelled(task, question, answer, choice)
        if choice == OPTION_RETRY:
            self._to(task, TaskState.RUNNING)
            return None
        if choice == OPTION_SKIP:
            self._emit(task, "skipped", {"step": task.cursor})
            task.cursor += 1
            self._to(task, TaskState.RUNNING)
            return None
        if not answer:
            return AskUser(question=question.question, options=question.options, kind=question.kind,
                           changes=question.changes, digest=question.digest, reason="the answer was empty",
                           source="user")
        chosen = choice or answer  # "2" means the second option's words, which is what the planner needs
        return Replan(suggestion=chosen, constraint=chosen, source="user")
