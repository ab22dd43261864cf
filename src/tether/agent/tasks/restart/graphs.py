"""Graph tasks on the agent server: choosing a step's device (`choose_device`), and a graph task its server
left running (`settle_graph`): what became of each step that was in flight, before it goes on.

Each step a graph had sent to a device with no result recorded (several branches may have been running)
is asked about on its device, as for a list plan (`tether.agent.tasks.restart`): a result the device
still holds is recorded as the step's result (the graph goes on from it, recovering a failure as usual);
an outcome that stays unknown is recorded as a failure marked `restart_unknown`, which the branch puts to
the person (retry, skip, cancel) and never re-runs by itself. Steps that had finished stay finished.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from tether.agent.run.graph import RESTART_UNKNOWN, RUNNING
from tether.agent.run.steps import short
from tether.agent.run.task import StepRecord, Task, TaskState
from tether.agent.tasks.restart.plans import SEQ_JUMP, InFlight
from tether.protocol.messages import OUTCOME_FINISHED, CallOutcome
from tether.protocol.models import Command, Result
from tether.protocol.profile import DeviceRequirements

Ask = Callable[[Task, str, InFlight], Awaitable[CallOutcome]]


def in_flight_steps(task: Task) -> list[InFlight]:
    """The graph's steps left running whose last `step_started` has no record (their command may have run)."""
    recorded = {r.command.call_id for r in task.steps}
    last: dict[int, dict[str, object]] = {}
    for event in task.events:
        if event.kind == "step_started" and isinstance(event.data.get("step"), int):
            last[event.data["step"]] = event.data
    flights = []
    for index, state in enumerate(task.step_states):
        data = last.get(index)
        if state != RUNNING or data is None or data.get("call_id") in recorded:
            continue
        device = data.get("device")
        flights.append(InFlight(index=index, call_id=str(data.get("call_id")),
                                device=device if isinstance(device, str) else None, started=dict(data)))
    return flights


async def settle_graph(service: Any, task: Task) -> None:
    """Record what each step in flight came to (see the module docstring), then run the task on, unless it was
    cancelled, taken over or the server closes meanwhile. `service`: the `TaskService` (its outcome query, which
    waits while a device reports the call still running, and its bookkeeping)."""
    seen = task.events[-1].seq if task.events else -1
    await record_outcomes(task, service._step_outcome)
    if task.id in service._live and not service._closing and not task.state.terminal:
        waiting = task.state is TaskState.WAITING_FOR_USER and task.pending_question is not None
        if not waiting and task.state is not TaskState.RUNNING:  # e.g. waiting, its question since answered
            task.transition(TaskState.RUNNING, reason="server restarted")
        service._settled(task, "run")  # an open question's branch asks on; the other branches go on
        for event in [e for e in task.events if e.seq > seen]:  # what the settling said, to followers here
            service._on_event(task, event)


async def record_outcomes(task: Task, ask: Ask) -> None:
    """Record what each step in flight came to; `ask(task, device, flight)` is the device's outcome."""
    last = task.events[-1].seq if task.events else -1
    task.record("server_restarted", {"state": task.state.value, "graph": True, "lost_after": last},
                seq=(last // SEQ_JUMP + 1) * SEQ_JUMP)
    for flight in in_flight_steps(task):
        device = flight.device or task.device
        why = "the step names no device"
        result: Result | None = None
        if device:
            try:
                outcome = await ask(task, device, flight)
            except Exception as exc:  # the person is asked instead
                why = f"the device could not be asked: {exc}"
            else:
                result = outcome.result if outcome.state == OUTCOME_FINISHED else None
                why = outcome.note or f"the device reports the call {outcome.state}"
        if result is None:
            result = Result.failure(f"the server restarted while this step ran and whether it finished is unknown "
                                    f"({why})", flight.call_id, result={"error_code": RESTART_UNKNOWN})
        assert task.plan is not None
        step = task.plan.steps[flight.index]
        args = flight.started.get("args")
        command = Command(tool_name=step.skill, parameters=args if isinstance(args, dict) else dict(step.args),
                          call_id=flight.call_id)
        attempt = flight.started.get("attempt")
        attempt = attempt if isinstance(attempt, int) else 1
        ran = step if device == step.device else step.model_copy(update={"device": device})
        task.steps.append(StepRecord(index=flight.index, attempt=attempt, step=ran, command=command, result=result,
                                     started_at=datetime.now(UTC)))
        task.record("step_finished", {"step": flight.index, "attempt": attempt, "status": result.status.value,
                                      "error": result.error, "result": short(result.result), "from_device": True,
                                      "device": device})


def choose_device(service: Any, task: Task, requires: DeviceRequirements) -> tuple[str, str]:
    """The device for a graph step that gives `requires` instead of a device: the least-loaded connected one
    that meets it within the task's scope (`DeviceRegistry.select`), and why, in words; `LookupError` saying
    why each device does not fit. `service`: the `TaskService` (its registry and scope check)."""
    from tether.server.aip.fleet.matching import NoDeviceError, rejection

    registry = service.registry
    try:
        record = registry.select(requires, lambda r: service.reaches(task, r.name))
    except NoDeviceError as exc:
        raise LookupError(str(exc)) from None
    others = [r for r in registry.list() if r.name != record.name and service.reaches(task, r.name)]
    fitting = [r.name for r in others if rejection(r, requires) is None]
    wanted = requires.model_dump(exclude_defaults=True) or "anything"
    why = (f"it meets {wanted}" + (f" and is the least loaded of {', '.join(sorted([record.name, *fitting]))}"
                                   if fitting else ", the only connected device that does")
           + f" (load {record.load})")
    return record.name, why
