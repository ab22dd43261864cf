"""A person's or an agent's edit of a running graph task on this server (`POST /api/v1/tasks/{id}/edits`).

`edit_graph` checks who may make it, then hands it to the task's running `GraphRun` (agent/run/graph/outside.py),
which checks it whole against the graph and applies it at once or refuses it with every reason:

- the token needs `execute` on every device the edit touches: the devices of the steps it adds (a `transfer`
  step's sender too) and of the steps it removes or adds needs to; a step it adds must name its device (or
  none, for the task's own device) when the token is scoped, since a device chosen later by `requires` or a
  step `on: all` could reach beyond the token's scope. Every device must also be within the task's own scope.
- a device the task did not use yet joins it (its tools are asked for, so the plan check knows them).
- an agent's edit that adds steps waits for a person's confirmation when the task's confirm mode (or the
  agent token's, the stricter) asks for it, as a re-planned part does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tether.agent.planning.edits import EditRefused, GraphEdit
from tether.agent.planning.graph import need_index
from tether.agent.planning.plan import PlanStep
from tether.agent.run.confirm import CONFIRM_MODES, needs_confirmation
from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.transfer_step import transfer_tool
from tether.server.store.tokens import TokenInfo


class GraphEditRefused(TaskError):
    """The edit does not fit the graph (422) or changes steps that have started (409); `reasons` says why."""

    def __init__(self, status: int, reasons: list[str]) -> None:
        super().__init__(status, "the edit was refused: " + "; ".join(reasons))
        self.reasons = reasons


def stricter(*modes: str) -> str:
    """The strictest of confirmation modes (never < destructive < always)."""
    known = [m for m in modes if m in CONFIRM_MODES]
    return max(known, key=CONFIRM_MODES.index) if known else "never"


def _touched(service: Any, task: Any, graph: Any, edit: GraphEdit, who: TokenInfo) -> list[str]:
    """The devices the edit touches (the task's own device for a step naming none); TaskError when a step
    it adds leaves its device to be chosen and the token is scoped."""
    devices: list[str] = []
    for step in edit.add:
        if step.device is None and (step.requires is not None or step.on == "all") and who.scoped:
            raise TaskError(403, f"token '{who.name}' is scoped ({who.scope_text()}): a step it adds must name its "
                                 "device (a device chosen by requires, or every device, could be beyond its scope)")
        devices += _step_devices(step, task.device)
    steps = graph.plan.steps
    ids = graph._ids()
    for name in [*edit.remove, *edit.add_needs]:
        index = need_index(name, ids, len(steps))
        if index is not None:
            devices.append(graph._device(index) or task.device or "")
    return [d for d in dict.fromkeys(devices) if d]


def _step_devices(step: PlanStep, default: str | None) -> Iterable[str]:
    if step.device or default:
        yield str(step.device or default)
    if step.skill == "transfer" and isinstance(step.args.get("from"), str):
        yield step.args["from"]


async def edit_graph(service: Any, task_id: str, edit: GraphEdit, who: TokenInfo, by: str) -> dict[str, Any]:
    """Apply `edit` to the running graph task `task_id` for the token `who` (recorded as `by`).

    Returns {"task", "status": "applied" | "waiting_for_confirmation" (the task's question asks a person;
    its log records the edit or its refusal once answered), "step_states"}. Raises `TaskError`: 409 when
    the task is not running a graph here now, 403 for a device beyond the token's scope, 422 for a device
    beyond the task's; `GraphEditRefused` (409/422, with the reasons) for an edit the graph refuses, which
    is also an `edit_refused` event in the task's log."""
    task = await service.steerable(task_id)  # a task not in memory is read off the event loop

    def running_graph() -> Any:
        running = service._runners.get(task.id)
        graph = running[0].graph if running is not None else None
        if graph is None or task.state.terminal:
            raise TaskError(409, f"task {task.id} is not running a graph plan now (it is {task.state.value}); only "
                                 "the steps of a running graph can be edited")
        return running[0], graph

    runner, graph = running_graph()
    for device in _touched(service, task, graph, edit, who):
        record = service.registry.get(device)
        if not who.reaches(device, record.tags if record is not None else ()):
            raise TaskError(403, f"token '{who.name}' may not edit steps on device '{device}': it is outside the "
                                 f"token's scope ({who.scope_text()})")
        if not service.reaches(task, device):
            raise TaskError(422, f"device '{device}' is outside the scope of the token that created the task")
        if device not in runner.tools:  # a device new to the task: the plan check needs its tools
            tools = await service._device_tools(device)
            if service.transfers is not None:
                tools.append(transfer_tool())
            runner.tools[device] = tools
            if device not in task.devices and device != task.device:
                task.devices.append(device)
            runner, graph = running_graph()  # it may have ended meanwhile
    confirm = who.agent and needs_confirmation(stricter(task.confirm, who.confirm), edit.add, runner.tools)
    try:
        status = graph.edit(edit, by, confirm=confirm)
    except EditRefused as exc:
        started = all("only a step that has not started" in p or "only a step that ran" in p for p in exc.problems)
        raise GraphEditRefused(409 if started else 422, exc.problems) from None
    return {"task": task.id, "status": status, "step_states": list(task.step_states)}
