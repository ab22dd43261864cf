"""What a task's life tells the server's notifier (`tether.server.notify`): an approval or a question waiting
for a person (`approval.needed`), a task done (`task.finished`) or failed (`task.failed`); and, on every
change of state, the inbox's live signal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.agent.run.replies import APPROVAL_KINDS
from tether.agent.run.task import Task, TaskEvent
from tether.server.trust.approvals import dashboard_url, server_url, token_of

if TYPE_CHECKING:
    from tether.server.aip.fleet.registry import DeviceRegistry
    from tether.server.notify.notifier import Notifier


def tell(notifier: Notifier, registry: DeviceRegistry, task: Task, event: TaskEvent) -> None:
    """Tell `notifier` what this state event of `task` means (nothing for other events)."""
    if event.kind != "state":
        return
    to = event.data.get("to")
    names = [n for n in dict.fromkeys([task.device, *task.devices, *task.devices_used()]) if n]
    devices = [(n, r.tags if (r := registry.get(n)) is not None else ()) for n in names]
    link = dashboard_url(server_url(notifier.settings), task.id)
    fields = {"Task": task.id, "Request": task.request, "Device": ", ".join(names), "Asked by": task.requested_by}
    asker = token_of(task.requested_by) if task.requested_by else None
    pending = task.pending_question
    if to == "waiting_for_user" and pending is not None:
        approval = pending.kind in APPROVAL_KINDS
        notifier.emit("approval.needed", f"{'Approval' if approval else 'An answer'} needed for task {task.id[:12]}: "
                      f"{pending.question}", {**fields, "Options": " / ".join(pending.options)},
                      data={"kind": "task", "task": task.id, "question_id": pending.id, "question_kind": pending.kind,
                            "question": pending.question, "options": pending.options, "digest": pending.digest},
                      devices=devices, answer_scope="approve" if approval else "execute",
                      asker=asker.removeprefix("api:") if asker else None, link=link)
    elif to == "done":
        notifier.emit("task.finished", f"Task {task.id[:12]} finished: {task.request}",
                      {**fields, "Answer": task.answer}, data={"task": task.id, "state": "done",
                                                                "answer": task.answer},
                      devices=devices, link=link)
    elif to == "failed":
        notifier.emit("task.failed", f"Task {task.id[:12]} failed: {task.error or task.request}",
                      {**fields, "Error": task.error}, data={"task": task.id, "state": "failed", "error": task.error},
                      devices=devices, link=link)
    else:  # leaving a wait (answered, cancelled…): the inbox changes
        notifier.changes.bump()
