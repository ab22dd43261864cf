"""Asking a person whether new steps of a running graph may run (a re-plan's or an outside edit's)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from tether.agent.run.confirm import CONFIRMATION, confirmation_answer
from tether.agent.run.decisions import AskUser
from tether.agent.run.rounds import CONFIRM_TRIES
from tether.agent.run.task import Question, Task, TaskState


async def ask_to_run(runner: Any, task: Task, record: Question) -> bool | None:
    """Put `record` (a confirmation question) to the person through `runner.ask`, up to `CONFIRM_TRIES`
    answers until one is yes or no; the task waits meanwhile and every answer is an event. Returns True (run
    them), False (do not) or None (no usable answer); the record keeps the last answer. The caller holds the
    runner's `asking` lock and moves the task on afterwards."""
    task.questions.append(record)
    runner._to(task, TaskState.WAITING_FOR_USER, question=record.id)
    runner._emit(task, "question", record.model_dump(mode="json"))
    decided: bool | None = None
    answer = ""
    for _ in range(CONFIRM_TRIES):
        asked = runner.clock()
        try:
            raw = await runner.ask(AskUser(question=record.question, options=record.options,
                                           reason=CONFIRMATION, source="user"))
        finally:
            runner._waited += runner.clock() - asked
        answer = (raw or "").strip()
        decided = confirmation_answer(answer)
        runner._emit(task, "user_answer", {"question": record.id, "answer": answer,
                                           **({"ignored": True} if decided is None else {})})
        if decided is not None:
            break
    record.answer, record.answered_at = answer, datetime.now(UTC)
    return decided
