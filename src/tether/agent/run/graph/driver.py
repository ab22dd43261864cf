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
- takes edits from outside (a person's or an agent's, outside.py) between two turns of its loop, woken by them;
- stops every running branch when the task is cancelled or ends.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from tether.agent.planning.graph import dependants, dependencies, label, step_ids
from tether.agent.planning.plan import OBSERVE, Plan
from tether.agent.planning.refs import ERROR_CODE as REF_ERROR_CODE
from tether.agent.planning.refs import RefError, has_refs, resolve
from tether.agent.run.graph.mend import Mending
from tether.agent.run.graph.outside import OutsideEdits
from tether.agent.run.graph.states import DONE, ENDED, FAILED, GONE, PENDING, RUNNING, SKIPPED, Chooser
from tether.agent.run.steps import fan_out_step, short
from tether.agent.run.task import Question, StepRecord, Task, TaskState
from tether.protocol.models import Command, Result
from tether.protocol.profile import DeviceRequirements


class GraphRun(Mending, OutsideEdits):
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
        self.wake = asyncio.Event()  # set by an edit from outside (outside.py): the scheduler looks again
        self.edits: set[asyncio.Task[None]] = set()  # edits from outside waiting for a person's confirmation

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
                self.wake.clear()
                self._schedule()
                self.edits = {job for job in self.edits if not job.done()}
                if not self.jobs and not self.edits:
                    break
                woken = asyncio.create_task(self.wake.wait())
                try:
                    done, _ = await asyncio.wait([*self.jobs.values(), woken], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                for index in [i for i, job in self.jobs.items() if job in done]:
                    job = self.jobs.pop(index)
                    if job.exception() is not None:
                        raise job.exception()  # type: ignore[misc]
        finally:
            for job in [*self.jobs.values(), *self.edits]:
                job.cancel()
            await asyncio.gather(*self.jobs.values(), *self.edits, return_exceptions=True)
            self.jobs.clear()
            self.edits.clear()

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
        try:
            if self.choose is None:
                raise LookupError("this task runs on one device: requires chooses among an agent server's devices")
            name, why = self.choose(requires)
        except LookupError as exc:
            self.runner._end(self.task, TaskState.FAILED, f"{label(self.plan.steps, index)}: {exc}")
            raise  # not reached: _end raises
        self.task.step_devices[str(index)] = name
        if name not in self.runner.tools:
            self.runner.tools[name] = self.runner.tools.get(None, [])
        self.runner._emit(self.task, "device_chosen", {"step": index, "device": name, "why": why,
                                                       "requires": requires.model_dump(exclude_defaults=True)})

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

