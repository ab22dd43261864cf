"""The followers of a task's events: subscribing, feeding and ending their streams."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

from tether.agent.run.task import Task, TaskEvent
from tether.agent.tasks.service.core import ServiceCore

_SUBSCRIBER_QUEUE = 10_000


class Followers(ServiceCore):
    """The task service's followers: each a queue of a task's next events (None ends it)."""

    def is_running_here(self, task_id: str) -> bool:
        return task_id in self._live

    def has_followers(self, task_id: str) -> bool:
        return task_id in self._subscribers

    def feed(self, task_id: str, event: TaskEvent) -> None:
        """Give the followers of the task here its next event."""
        for queue in list(self._subscribers.get(task_id, ())):
            if queue.qsize() < _SUBSCRIBER_QUEUE - 1:
                queue.put_nowait(event)
            else:  # a follower this far behind is ended, not fed a gap: it resumes with ?after=SEQ
                self._subscribers[task_id].discard(queue)
                queue.put_nowait(None)

    def subscribe(self, task_id: str, after: int = -1, found: Task | None = None
                  ) -> tuple[Task, builtins.list[TaskEvent], asyncio.Queue[TaskEvent | None] | None]:
        """The events so far (after `after`) and, for a task still going, a queue of what comes next
        (None marks the end). Both come from one moment, so nothing is missed or seen twice. `found`: the
        task as `fetch` read it just now; a task not in memory is then not read again (on the event loop)."""
        if found is None:
            task = self.get(task_id)
        else:  # the live object when in memory (`get` finds it there by its whole id), else as read just now
            task = self.get(found.id) if found.id in self._live or found.id in self._saver.unsaved else found
        held = self._held.get(task.id)  # an end not saved yet: not told before it is (`Running._end`)
        cut = self._untold(task.id)  # events not saved yet: told once they are (`Running._on_event`)
        past = [e for e in task.events if e.seq > after and (cut is None or e.seq < cut)]
        if task.state.terminal and task.id not in self._runners and held is None:
            return task, past, None
        queue: asyncio.Queue[TaskEvent | None] = asyncio.Queue()
        self._subscribers.setdefault(task.id, set()).add(queue)
        return task, past, queue

    def release_followers(self) -> None:
        """The server is stopping: every follower's stream ends now (its `end` says the task is still
        going), before the web server waits on open connections and would cancel them mid-frame."""
        for task_id in list(self._subscribers):
            self._end_followers(task_id)

    def end_followers(self, task_id: str) -> None:
        self._end_followers(task_id)

    def end_of(self, task: Task) -> dict[str, Any]:
        """What a follower's stream ends with: the task's id, state, whether it ended, its answer and error. A
        task whose end is not saved yet (`ending`) is not ended: its state is the one the store holds, and
        `ending` says what it ended as and why that is not saved."""
        body = self.shown(task, {"id": task.id, "state": task.state.value, "ended": task.state.terminal,
                                 "answer": task.answer, "error": task.error})
        if body.get("ending") is not None:
            body["ended"] = False
        return body

    def _end_followers(self, task_id: str) -> None:
        """Every follower's stream of this task ends (None): the task ended, or the server closes."""
        for queue in self._subscribers.pop(task_id, set()):
            queue.put_nowait(None)

    def unsubscribe(self, task_id: str, queue: asyncio.Queue[TaskEvent | None]) -> None:
        queues = self._subscribers.get(task_id)
        if queues is not None:
            queues.discard(queue)
