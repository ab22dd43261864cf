"""What a restarted server does with a task the previous one left unfinished: resume it, or ask.

A task is never forgotten and never silently re-runs a command that may already have had its
effect. The saved task tells which case it is in (the service saves a step's start before the
command is sent, and its record as soon as the result is in):

- waiting for a person: it keeps waiting; the answer resumes it where it stopped;
- created, or planning: nothing ran on a device since, so it runs (plans) again;
- a step started with no result recorded: its device is asked first (an OUTCOME_QUERY, answered from the
  device's exactly-once record of finished calls, `TaskService` does it before settling): when the device
  still holds the step's result, that result is recorded and the plan goes on from it (a success) or the
  person is told the real failure; only when the outcome is really unknown (the device is offline, does
  not answer, or has no record of the call) is the person asked — retry, skip, or cancel;
- a failure whose recovery was being decided: the person is asked — retry, skip, or cancel;
- a step whose success was recorded before the cursor moved on: it goes on from the next step.

Only a server that holds its node's lease on the database runs this, and only after it bound its port
(`tether.server.main.StateClaim`): a second server started by mistake on the same state is refused before
it reads a task, so it can never turn a task the running server is finishing into a restart question.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from tether.agent.planning.plan import PlanStep
from tether.agent.run.decisions import OPTION_CANCEL, OPTION_RETRY, OPTION_SKIP
from tether.agent.run.steps import short
from tether.agent.run.task import Question, StepRecord, Task, TaskState
from tether.protocol.models import Command, Result

Settled = Literal["wait", "run"]
SEQ_JUMP = 1_000_000


@dataclass(frozen=True, slots=True)
class InFlight:
    """The step a task had sent to its device when its server stopped, with no result recorded: its
    plan `index`, the `call_id` of the command, the `device` it went to (None: the task's own), and the
    `step_started` event's data (skill, args, attempt)."""

    index: int
    call_id: str
    device: str | None
    started: dict[str, Any]


def in_flight_step(task: Task) -> InFlight | None:
    """The step whose command may have run without its result being recorded, when `task` (as loaded after
    its server stopped) has one: a running task whose last `step_started` has no step record. None for a
    step `on: all` (many devices: no one call to ask about) and for every other state."""
    if task.state is not TaskState.RUNNING or task.plan is None or not task.plan.steps:
        return None
    started = [e for e in task.events if e.kind == "step_started"]
    if not started:
        return None
    data = started[-1].data
    call_id = data.get("call_id")
    if not isinstance(call_id, str) or call_id in {r.command.call_id for r in task.steps}:
        return None
    index = data.get("step", task.cursor)
    if not isinstance(index, int) or index != task.cursor or task.plan.steps[index].on == "all":
        return None
    device = data.get("device")
    return InFlight(index=index, call_id=call_id, device=device if isinstance(device, str) else None,
                    started=dict(data))


def settle_after_restart(task: Task, known: Result | None = None, unknown_why: str | None = None) -> Settled:
    """Bring an unfinished task into a state a new runner can take up; say whether to run it now.

    `known`: the result the device reported for the step in flight (`in_flight_step`), from its record of
    finished calls. It is recorded as the step's result (event `step_finished` with `"from_device": true`); a
    success moves the plan on, a failure is put to the person with the device's error. `unknown_why`: why
    the device could not say (put into the question when the outcome stays unknown)."""
    state = task.state
    # Streamed output and answer tokens are saved with the next step event, so a crash loses the
    # last few, and a follower may have seen sequence numbers the saved task never reached. New
    # events start at the next million so a follower resuming with `after=N` misses none of them.
    last = task.events[-1].seq if task.events else -1
    task.record("server_restarted", {"state": state.value, "step": task.cursor, "lost_after": last},
                seq=(last // SEQ_JUMP + 1) * SEQ_JUMP)
    if state is TaskState.WAITING_FOR_USER and task.pending_question is not None:
        return "wait"
    if state in (TaskState.RUNNING, TaskState.RECOVERING) and task.plan is not None and task.plan.steps:
        last_step = task.steps[-1] if task.steps else None
        started = [e for e in task.events if e.kind == "step_started"]
        recorded = {r.command.call_id for r in task.steps}
        in_flight = bool(started) and started[-1].data.get("call_id") not in recorded
        flight = in_flight_step(task) if in_flight and known is not None else None
        if flight is not None and known is not None:
            _record_known(task, flight, task.plan.steps[flight.index], known)
            if known.ok:
                task.cursor += 1
                task.transition(TaskState.RUNNING, reason="server restarted; the device had finished the step")
                return "run"
        if in_flight or state is TaskState.RECOVERING:
            step = task.plan.steps[min(task.cursor, len(task.plan.steps) - 1)]
            if flight is not None and known is not None:
                what = ("was running; the device reports that it finished and failed: "
                        f"{known.error or 'no error given'}. Retry the step, skip it, or cancel the task?")
            else:
                what = (("was running" if in_flight else "had failed and its recovery was being decided")
                        + "; whether it finished on the device is unknown"
                        + (f" ({unknown_why})" if in_flight and unknown_why else "")
                        + ". Retry the step, skip it, or cancel the task?")
            record = Question(step=task.cursor, kind="restart", options=[OPTION_RETRY, OPTION_SKIP, OPTION_CANCEL],
                              question=f"The server restarted while step {task.cursor + 1} ({step.skill} "
                                       f"{step.args}) {what}")
            task.questions.append(record)
            task.transition(TaskState.WAITING_FOR_USER, question=record.id)
            task.record("question", record.model_dump(mode="json"))
            return "wait"
        if last_step is not None and last_step.index == task.cursor and last_step.result.ok:
            task.cursor += 1  # it finished; the server stopped before the cursor moved on
    if state is TaskState.WAITING_FOR_USER:  # waiting, but no question is left open: go on
        task.transition(TaskState.RUNNING, reason="server restarted")
    return "run"


def _record_known(task: Task, flight: InFlight, step: PlanStep, result: Result) -> None:
    """The device's result for the step in flight, recorded as the runner records a step's result."""
    started = flight.started
    command = Command(tool_name=step.skill, parameters=started.get("args") if isinstance(started.get("args"), dict)
                      else dict(step.args), call_id=flight.call_id, approved_by=started.get("approved_by"))
    attempt = started.get("attempt") if isinstance(started.get("attempt"), int) else 1
    task.steps.append(StepRecord(index=flight.index, attempt=attempt, step=step, command=command, result=result,
                                 started_at=datetime.now(UTC)))
    task.record("step_finished", {"step": flight.index, "attempt": attempt, "status": result.status.value,
                                  "error": result.error, "result": short(result.result), "from_device": True})

