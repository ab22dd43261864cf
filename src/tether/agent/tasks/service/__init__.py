"""`TaskService`: tasks on the agent server — run on the hub's devices, stored as they go, answerable.

One `TaskRunner` per live task, each an asyncio task on the server's loop. The service is what the
task API talks to: it creates tasks (choosing the device), feeds answers and approvals to the runner
waiting on them, cancels, streams events to subscribers, and undoes a task on every device it
touched. Every state change, step, decision, question and answer is saved before the next thing
happens, so a server that dies loses at most the streamed output of the step that was running.

After a restart (`start`), or when it takes over a task whose server stopped, each unfinished task is
settled, never forgotten: a step that was in flight is first asked about on its device (its record of
finished calls), and the task resumed from that outcome; it is held with a question for the person only
when the command may or may not have run and the device cannot say (see `tether.agent.tasks.restart`).

The service is one class made of its parts, one module each: its state and reads (`core`), its
followers (`followers`), its runners (`running`), steering (`answering`), start, close and restart
(`lifecycle`), creation (`creating`) and undo (`undo`).
"""

from __future__ import annotations

from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.service.answering import judged_question
from tether.agent.tasks.service.creating import Creating
from tether.agent.tasks.service.lifecycle import Lifecycle
from tether.agent.tasks.service.running import DeviceUnavailable
from tether.agent.tasks.service.undo import Undoing

__all__ = ["DeviceUnavailable", "TaskError", "TaskService", "judged_question"]


class TaskService(Lifecycle, Creating, Undoing):
    """Tasks on the agent server (see the module docstring). `hub` and `registry`: the devices; `store`: the
    tasks' store; `llm`: plans and answers (None: only given plans run); `server_store`: the audit log's
    health and the sessions' owners; `budgets`, `command_timeout`, `device_wait` (seconds a device that is
    away is waited for); `transfers`: runs `transfer` steps (None: not offered); `notifier`: webhooks and
    the approval inbox."""
