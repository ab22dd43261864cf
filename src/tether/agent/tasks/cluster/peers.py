"""`TaskPeers`: a node's tasks as the other nodes of a cluster see and steer them.

Each task runs on one node, the one holding its lease (`tether.agent.tasks.cluster.ownership`). Two things must
still work from every node:
- following it: the node running it relays each event (and, once it saved the task, its end) over
  the cluster's relay; the other nodes feed their own followers of that task, whose streams began
  with the stored events (duplicates are skipped by sequence number in the stream);
- steering it: an answer, approval or cancel sent to another node is forwarded to the running node
  (`task.steer` on the bus), which applies it as if asked itself and sends back the summary or its
  refusal, with the HTTP status it would have answered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from tether.agent.run.task import Task, TaskEvent
from tether.agent.tasks.errors import TaskError

if TYPE_CHECKING:
    from tether.server.ports import RemoteDevices

STEER_TIMEOUT_S = 30.0  # an answer or cancel forwarded to the node running the task


class LocalTasks(Protocol):
    """What the peers need of this node's task service (`tether.agent.tasks.service.TaskService` is one)."""

    def is_running_here(self, task_id: str) -> bool: ...

    def has_followers(self, task_id: str) -> bool: ...

    def end_followers(self, task_id: str) -> None: ...

    def feed(self, task_id: str, event: TaskEvent) -> None: ...

    async def steer_here(self, task_id: str, action: str, by: str, args: dict[str, Any]) -> Task: ...


class TaskPeers:
    """This node's side of the cluster's task relay: relays its tasks' events and ends to the other nodes,
    feeds theirs to its own followers, and forwards steering (`steer`) to the node running a task."""

    def __init__(self, service: LocalTasks, remote: RemoteDevices) -> None:
        self.service = service
        self.remote = remote
        self._unrelay = remote.on_relay("task", self._relayed)
        remote.handle("task.steer", self._steer_here)

    def close(self) -> None:
        self._unrelay()

    # -- following ---------------------------------------------------------------------------------

    def event(self, task_id: str, event: TaskEvent) -> None:
        self.remote.relay("task", {"task": task_id, "event": event.model_dump(mode="json")})

    def ended(self, task_id: str) -> None:
        """Sent after the task's final save: the other nodes' followers end with the stored state."""
        self.remote.relay("task", {"task": task_id, "ended": True})

    def _relayed(self, data: dict[str, Any]) -> None:
        service = self.service
        task_id = str(data.get("task", ""))
        if service.is_running_here(task_id) or not service.has_followers(task_id):
            return
        if data.get("ended"):
            service.end_followers(task_id)
            return
        try:
            event = TaskEvent.model_validate(data.get("event"))
        except ValueError:
            return
        service.feed(task_id, event)

    # -- steering ----------------------------------------------------------------------------------

    async def steer(self, holder: str, task_id: str, action: str, by: str, args: dict[str, Any]) -> dict[str, Any]:
        body = {"task": task_id, "action": action, "by": by, "args": args}
        try:
            reply = await self.remote.call(holder, "task.steer", body, STEER_TIMEOUT_S)
        except Exception as exc:
            raise TaskError(503, f"task {task_id} is run by node {holder}, which did not answer: {exc}") from None
        if "error" in reply:
            raise TaskError(int(reply.get("status") or 409), str(reply["error"]))
        return dict(reply["task"])

    async def _steer_here(self, body: dict[str, Any]) -> dict[str, Any]:
        """Another node's steering of a task this node runs (never forwarded again)."""
        try:
            task = await self.service.steer_here(str(body.get("task", "")), str(body.get("action", "")),
                                                 str(body.get("by") or "another node"), dict(body.get("args") or {}))
        except TaskError as exc:
            return {"error": str(exc), "status": exc.status}
        return {"task": task.summary()}
