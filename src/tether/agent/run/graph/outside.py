"""Edits of a running graph from outside the run: a person or an agent adds steps, removes steps that have not
started, or adds needs (`POST /api/v1/tasks/{id}/edits`, `tether edit`, the gateway's `edit_task`).

`GraphRun` (driver.py) inherits `OutsideEdits`. An edit is checked whole against the graph as it stands
(`planning/edits.apply_edit`) and applied at once, with no `await` in between (plan and states together),
then the scheduler is woken so new steps whose needs have ended start; or it is refused with every reason.
Either way it is an event in the task's log: `edit` (with `source: "api"` and who sent it) or `edit_refused`.

An edit that must be confirmed first (an agent's that adds steps, when the task's confirm mode asks for it,
as for a re-planned part) waits for a person in the background: one question of the task at a time, the
other branches go on. "run" applies it, checked again against the graph as it is then (it may have moved
on: refused then, with the reasons); "cancel" drops the edit and the task goes on.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tether.agent.planning.edits import EditRefused, GraphEdit, apply_edit
from tether.agent.planning.plan import Plan
from tether.agent.run.confirm import (
    CONFIRMATION,
    OPTION_CANCEL,
    OPTION_RUN,
    plan_digest,
    plan_text,
)
from tether.agent.run.graph.asking import ask_to_run
from tether.agent.run.task import Question, Task, TaskState

APPLIED, WAITING = "applied", "waiting_for_confirmation"


class OutsideEdits:
    """Mixed into `GraphRun`; see the module docstring."""

    # provided by GraphRun
    runner: Any
    task: Task
    asking: asyncio.Lock
    wake: asyncio.Event
    edits: set[asyncio.Task[None]]

    def edit(self, edit: GraphEdit, by: str, *, confirm: bool) -> str:
        """Apply `edit` (sent by `by`) now: `APPLIED`; or, with `confirm` and new steps, ask a person first in
        the background: `WAITING`. Raises `EditRefused` (every reason; an `edit_refused` event is recorded)
        when the edit does not fit the graph as it stands."""
        new_plan, new_states = self._checked(edit, by)
        if confirm and edit.add:
            job = asyncio.create_task(self._confirm_edit(edit, by), name=f"task {self.task.id} edit")
            self.edits.add(job)
            job.add_done_callback(lambda _: self.wake.set())
            return WAITING
        self._commit(edit, by, new_plan, new_states)
        return APPLIED

    def _checked(self, edit: GraphEdit, by: str) -> tuple[Plan, list[str]]:
        try:
            assert self.task.plan is not None
            return apply_edit(self.task.plan, self.task.step_states, edit, self.runner.tools)
        except EditRefused as exc:
            self.runner._emit(self.task, "edit_refused", {"source": "api", "by": by, "reasons": exc.problems,
                                                          "edit": edit.summary()})
            raise

    def _commit(self, edit: GraphEdit, by: str, new_plan: Plan, new_states: list[str]) -> None:
        self.task.plan = new_plan
        self.task.step_states = new_states
        self.runner._emit(self.task, "edit", {"source": "api", "by": by, **edit.summary()})
        self.wake.set()  # the scheduler looks again: new steps whose needs have ended start now

    async def _confirm_edit(self, edit: GraphEdit, by: str) -> None:
        runner, task = self.runner, self.task
        assert task.plan is not None
        first = len(task.plan.steps)
        async with self.asking:
            record = Question(step=first, kind=CONFIRMATION, options=[OPTION_RUN, OPTION_CANCEL],
                              question=f"An edit by {by} adds these steps to the running task. Run them? ('cancel' "
                                       "drops the edit; the task goes on)\n" + plan_text(edit.add, first),
                              digest=plan_digest(edit.add, first))
            decided = await ask_to_run(runner, task, record)
            runner._to(task, TaskState.RUNNING)
        if not decided:
            runner._emit(task, "edit_refused", {"source": "api", "by": by, "edit": edit.summary(),
                                                "reasons": ["a person did not confirm the new steps"]})
            return
        try:
            new_plan, new_states = self._checked(edit, by)  # the graph may have moved on while the person read it
        except EditRefused:
            return
        self._commit(edit, by, new_plan, new_states)
