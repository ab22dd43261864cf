"""`settle_after_restart`: an unfinished task is resumed, or held with a question — never re-run blindly."""

from __future__ import annotations

from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.run.task import Question, StepRecord, Task, TaskState
from tether.agent.tasks.restart.plans import settle_after_restart
from tether.protocol.models import Command, Result, ResultStatus


def task_at(state: TaskState, *, started: bool = False, recorded_ok: bool | None = None) -> Task:
    """A two-step task moved to `state` the way the runner moves it."""
    steps = [PlanStep(skill="write_file", args={"file_path": "/tmp/a", "content": "x"}),
             PlanStep(skill="read_file", args={"file_path": "/tmp/a"})]
    task = Task(request="r", plan=Plan(steps=steps))
    path = {TaskState.CREATED: [], TaskState.PLANNING: [TaskState.PLANNING],
            TaskState.RUNNING: [TaskState.RUNNING], TaskState.RECOVERING: [TaskState.RUNNING, TaskState.RECOVERING],
            TaskState.WAITING_FOR_USER: [TaskState.RUNNING, TaskState.WAITING_FOR_USER]}[state]
    for target in path:
        task.transition(target)
    if started or recorded_ok is not None:
        command = Command(tool_name="write_file", parameters=steps[0].args)
        task.record("step_started", {"step": 0, "call_id": command.call_id})
        if recorded_ok is not None:
            result = Result(status=ResultStatus.SUCCESS, call_id=command.call_id) if recorded_ok \
                else Result.failure("no", command.call_id)
            task.steps.append(StepRecord(index=0, step=steps[0], command=command, result=result))
    return task


def test_created_and_planning_tasks_run_again() -> None:
    for state in (TaskState.CREATED, TaskState.PLANNING):
        task = task_at(state)
        assert settle_after_restart(task) == "run" and task.state is state
        assert task.events[-1].kind == "server_restarted"


def test_a_step_in_flight_asks_instead_of_running_it_again() -> None:
    task = task_at(TaskState.RUNNING, started=True)
    assert settle_after_restart(task) == "wait"
    assert task.state is TaskState.WAITING_FOR_USER and task.cursor == 0
    question = task.pending_question
    assert question is not None and question.kind == "restart" and question.options == ["retry", "skip this step",
                                                                                        "cancel"]
    assert "write_file" in question.question and "unknown" in question.question


def test_a_recorded_success_moves_on_without_asking() -> None:
    task = task_at(TaskState.RUNNING, recorded_ok=True)
    assert settle_after_restart(task) == "run" and task.cursor == 1 and task.pending_question is None


def test_a_failure_being_recovered_asks() -> None:
    task = task_at(TaskState.RECOVERING, recorded_ok=False)
    assert settle_after_restart(task) == "wait" and task.pending_question is not None
    assert "recovery was being decided" in task.pending_question.question


def test_waiting_tasks_keep_waiting_and_a_stale_wait_runs() -> None:
    waiting = task_at(TaskState.WAITING_FOR_USER)
    waiting.questions.append(Question(question="approve?", options=["approve", "deny"], kind="approval"))
    assert settle_after_restart(waiting) == "wait" and waiting.pending_question is not None
    stale = task_at(TaskState.WAITING_FOR_USER)  # its question was answered just before the stop
    assert settle_after_restart(stale) == "run" and stale.state is TaskState.RUNNING


def test_events_after_a_restart_never_reuse_a_sequence_number() -> None:
    task = task_at(TaskState.RUNNING, started=True)
    last = task.events[-1].seq
    settle_after_restart(task)
    restarted = next(e for e in task.events if e.kind == "server_restarted")
    assert restarted.seq == 1_000_000 and restarted.data["lost_after"] == last
    seqs = [e.seq for e in task.events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert task.record("next").seq == task.events[-2].seq + 1
