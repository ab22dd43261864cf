"""What a restarted server does with a task the previous one left unfinished: resume it, or ask.

A task is never forgotten and never silently re-runs a command that may already have had its
effect. The saved task tells which case it is in (the service saves a step's start before the
command is sent, and its record as soon as the result is in):

- waiting for a person: it keeps waiting; the answer resumes it where it stopped;
- created, or planning: nothing ran on a device since, so it runs (plans) again;
- a step started with no result recorded, or a failure whose recovery was being decided: whether
  the step finished on its device is unknown, so the person is asked — retry, skip, or cancel;
- a step whose success was recorded before the cursor moved on: it goes on from the next step.

Only a server that holds its node's lease on the database runs this, and only after it bound its port
(`tether.server.main.StateClaim`): a second server started by mistake on the same state is refused before
it reads a task, so it can never turn a task the running server is finishing into a restart question.
"""

from __future__ import annotations

from typing import Literal

from tether.agent.recovery import OPTION_CANCEL, OPTION_RETRY, OPTION_SKIP
from tether.agent.task import Question, Task, TaskState

Settled = Literal["wait", "run"]
SEQ_JUMP = 1_000_000


def settle_after_restart(task: Task) -> Settled:
    """Bring an unfinished task into a state a new runner can take up; say whether to run it now."""
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
        if in_flight or state is TaskState.RECOVERING:
            step = task.plan.steps[min(task.cursor, len(task.plan.steps) - 1)]
            what = "was running" if in_flight else "had failed and its recovery was being decided"
            record = Question(step=task.cursor, kind="restart", options=[OPTION_RETRY, OPTION_SKIP, OPTION_CANCEL],
                              question=f"The server restarted while step {task.cursor + 1} ({step.skill} "
                                       f"{step.args}) {what}; whether it finished on the device is unknown. "
                                       "Retry the step, skip it, or cancel the task?")
            task.questions.append(record)
            task.transition(TaskState.WAITING_FOR_USER, question=record.id)
            task.record("question", record.model_dump(mode="json"))
            return "wait"
        if last_step is not None and last_step.index == task.cursor and last_step.result.ok:
            task.cursor += 1  # it finished; the server stopped before the cursor moved on
    if state is TaskState.WAITING_FOR_USER:  # waiting, but no question is left open: go on
        task.transition(TaskState.RUNNING, reason="server restarted")
    return "run"
