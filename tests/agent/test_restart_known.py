"""`settle_after_restart` with the outcome the step's device reported (issue 28, item 2): a finished step is
recorded and the plan goes on, a failure is put to the person with the device's own error, and an unknown
outcome is asked about as before, saying why."""

from __future__ import annotations

from tests.agent.test_restart import task_at
from tether.agent.run.task import TaskState
from tether.agent.tasks.restart.plans import in_flight_step, settle_after_restart
from tether.protocol.models import Result, ResultStatus


def test_the_step_in_flight_is_found_with_its_call_and_device() -> None:
    task = task_at(TaskState.RUNNING, started=True)
    flight = in_flight_step(task)
    assert flight is not None and flight.index == 0 and flight.call_id == task.events[-1].data["call_id"]
    assert in_flight_step(task_at(TaskState.RUNNING, recorded_ok=True)) is None  # its result is recorded
    assert in_flight_step(task_at(TaskState.RECOVERING, started=True)) is None  # a failure being decided
    assert in_flight_step(task_at(TaskState.CREATED)) is None


def test_a_success_the_device_reports_is_recorded_and_the_plan_goes_on() -> None:
    task = task_at(TaskState.RUNNING, started=True)
    call_id = task.events[-1].data["call_id"]
    done = Result(status=ResultStatus.SUCCESS, result={"bytes": 1}, call_id=call_id)
    assert settle_after_restart(task, known=done) == "run"
    assert task.state is TaskState.RUNNING and task.cursor == 1 and task.pending_question is None
    [record] = task.steps
    assert record.index == 0 and record.command.call_id == call_id and record.result == done
    finished = [e for e in task.events if e.kind == "step_finished"]
    assert finished[-1].data["from_device"] is True and finished[-1].data["status"] == "success"


def test_a_failure_the_device_reports_is_put_to_the_person_with_its_error() -> None:
    task = task_at(TaskState.RUNNING, started=True)
    call_id = task.events[-1].data["call_id"]
    assert settle_after_restart(task, known=Result.failure("disk full", call_id)) == "wait"
    assert task.state is TaskState.WAITING_FOR_USER and task.cursor == 0
    question = task.pending_question
    assert question is not None and question.kind == "restart" and "disk full" in question.question
    assert task.steps[-1].result.error == "disk full"  # recorded: a retry is a second attempt, knowingly


def test_an_unknown_outcome_is_asked_about_saying_why() -> None:
    task = task_at(TaskState.RUNNING, started=True)
    assert settle_after_restart(task, unknown_why="device alpha is offline") == "wait"
    question = task.pending_question
    assert question is not None and "unknown (device alpha is offline)" in question.question
    assert not task.steps
