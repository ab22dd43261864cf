"""Undoing a task: its changed files put back on every device it touched."""

from __future__ import annotations

from typing import Any

from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.service.running import Running
from tether.protocol.models import Command


class Undoing(Running):
    """The task service's undo."""

    async def undo(self, task_id: str, requested_by: str) -> dict[str, Any]:
        """Put back the files the task changed, on every device its commands ran on, the device that changed
        something last first (a graph's branches ran on several devices at once)."""
        task = await self.fetch(task_id)
        if task.id in self._runners:
            raise TaskError(409, f"task {task.id} is still running; cancel it first")
        report: dict[str, Any] = {}
        for name in task.devices_undo_order():
            dispatcher = self.hub.dispatcher(name, session_id=task.id,
                                             requested_by=f"undo:{task.id[:12]} by {requested_by}")
            command = Command(tool_name="undo_session", parameters={"session_id": task.id},
                              approved_by=requested_by)
            [result] = await dispatcher.execute_commands([command], timeout=120)
            report[name] = {"restored": result.result} if result.ok else {"error": result.error}
        task.record("undone", {"devices": report})
        self._saver.save(task)
        return report
