"""The MCP tasks extension (`io.modelcontextprotocol/tasks`, MCP 2026-07-28) for device tool calls at `/mcp`.

A 2026-07-28 client that declares the extension in its request's capabilities may get, instead of a
`tools/call` result, a task handle (`resultType: "task"`): the gateway answers directly when the call is
over within `TASK_AFTER` seconds and asked nothing, and otherwise returns the handle at once: after
`TASK_AFTER`, or as soon as the call has a question (an approval, an external server's form), which the
task then holds as `input_required` with the question in `inputRequests` (each key used once, `q1`, `q2`,
...). The client polls `tasks/get` (the call's result in `result` once `completed`), answers questions with
`tasks/update` (its `inputResponses` by key; unknown or answered keys are ignored) and may `tasks/cancel`
(the device call is cancelled: its processes killed, the audit says so).

Tasks live in this server's memory, per token (another token's task id is "not found"), at most
`MAX_TASKS` at once (the oldest finished first, then the oldest), kept `TTL_MS` after they were created; a
question not answered within `ANSWER_TIMEOUT` seconds is cancelled as the synchronous path cancels it. Each
change of a task kept here is handed to `changed` (the gateway sends it as `notifications/tasks` to the
`subscriptions/listen` streams of the task's token that asked for it, handlers/listen.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import mcp_types as types
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

logger = logging.getLogger(__name__)

EXTENSION = "io.modelcontextprotocol/tasks"
TASK_AFTER = 2.0  # seconds a call may run (asking nothing) before its answer becomes a task handle
POLL_INTERVAL_MS = 500
TTL_MS = 3_600_000
MAX_TASKS = 1024
ANSWER_TIMEOUT = 600.0
TERMINAL = ("completed", "failed", "cancelled")

Elicit = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Work = Callable[[Elicit | None], Awaitable[types.CallToolResult]]


class TaskIdParams(types.RequestParams):
    """The params of `tasks/get` and `tasks/cancel`."""

    task_id: str


class TaskUpdateParams(TaskIdParams):
    """The params of `tasks/update`."""

    input_responses: dict[str, Any] = {}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class CallTask:
    """One device call run as a task: its state as `tasks/get` shows it, and its open questions."""

    task_id: str
    owner: str  # the token's id
    created: str = field(default_factory=_now)
    updated: str = field(default_factory=_now)
    born: float = field(default_factory=time.monotonic)
    status: str = "working"
    message: str | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    asked: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> elicitation/create request
    waiting: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    runner: asyncio.Task[Any] | None = None
    questions: int = 0
    question_asked: asyncio.Event = field(default_factory=asyncio.Event)
    changed: Callable[[CallTask], None] | None = None  # told of each change once the task is kept

    def touch(self, status: str | None = None, message: str | None = None) -> None:
        if status is not None and self.status not in TERMINAL:
            self.status = status
        if message is not None:
            self.message = message
        self.updated = _now()
        if self.changed is not None:
            self.changed(self)

    def view(self) -> dict[str, Any]:
        """The task as the extension's `Task` object (status-specific fields inlined)."""
        shown: dict[str, Any] = {"taskId": self.task_id, "status": self.status, "createdAt": self.created,
                                 "lastUpdatedAt": self.updated, "ttlMs": TTL_MS, "pollIntervalMs": POLL_INTERVAL_MS}
        if self.message:
            shown["statusMessage"] = self.message
        if self.status == "input_required":
            shown["inputRequests"] = dict(self.asked)
        elif self.status == "completed" and self.result is not None:
            shown["result"] = self.result
        elif self.status == "failed" and self.error is not None:
            shown["error"] = self.error
        return shown


class CallTasks:
    """The gateway's tasks: `run` a call that may become one; `get`, `update`, `cancel` them."""

    def __init__(self, changed: Callable[[CallTask], None] | None = None) -> None:
        self._tasks: dict[str, CallTask] = {}
        self._changed = changed

    def owns(self, owner: str, task_id: str) -> bool:
        """Whether `task_id` is a task of the token `owner` kept here."""
        task = self._tasks.get(task_id)
        return task is not None and task.owner == owner

    async def run(self, owner: str, work: Work, can_ask: bool) -> types.CallToolResult | dict[str, Any]:
        """The call's result if it ends within `TASK_AFTER` without a question, else a `CreateTaskResult`
        (a dict with `resultType: "task"`). `can_ask`: whether the client declared elicitation (questions
        are put into the task only then; otherwise `work` gets no way to ask)."""
        task = CallTask(task_id=secrets.token_urlsafe(18), owner=owner)

        async def elicit(message: str, schema: dict[str, Any]) -> dict[str, Any]:
            task.questions += 1
            key = f"q{task.questions}"
            waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            task.asked[key] = {"method": "elicitation/create", "params": {
                "mode": "form", "message": message, "requestedSchema": schema}}
            task.waiting[key] = waiter
            task.touch("input_required", message[:500])
            task.question_asked.set()
            try:
                async with asyncio.timeout(ANSWER_TIMEOUT):
                    return await waiter
            finally:
                task.asked.pop(key, None)
                task.waiting.pop(key, None)
                task.touch("working" if not task.asked else None)

        runner = asyncio.ensure_future(work(elicit if can_ask else None))
        task.runner = runner
        asked = asyncio.ensure_future(task.question_asked.wait())
        try:
            await asyncio.wait({runner, asked}, timeout=TASK_AFTER, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            runner.cancel()
            raise
        finally:
            asked.cancel()
        if runner.done() and not task.questions:
            return runner.result()
        self._keep(task)
        runner.add_done_callback(lambda done: self._finished(task, done))
        return {"resultType": "task", **task.view()}

    def _finished(self, task: CallTask, done: asyncio.Future[types.CallToolResult]) -> None:
        if done.cancelled():
            task.touch("cancelled", "cancelled by the client (tasks/cancel)")
            return
        exc = done.exception()
        if exc is not None:
            logger.warning("MCP gateway: task %s failed: %s", task.task_id[:8], exc)
            task.error = {"code": -32603, "message": "the call failed inside the server; the server log has "
                                                     "the details"}
            task.touch("failed")
            return
        task.result = done.result().model_dump(mode="json", by_alias=True, exclude_none=True)
        task.touch("completed")

    def _keep(self, task: CallTask) -> None:
        now = time.monotonic()
        for tid, old in list(self._tasks.items()):
            if (now - old.born) * 1000 > TTL_MS:
                self._drop(tid)
        while len(self._tasks) >= MAX_TASKS:
            finished = [tid for tid, t in self._tasks.items() if t.status in TERMINAL]
            self._drop(finished[0] if finished else next(iter(self._tasks)))
        self._tasks[task.task_id] = task
        task.changed = self._changed

    def _drop(self, task_id: str) -> None:
        task = self._tasks.pop(task_id, None)
        if task is not None and task.runner is not None and not task.runner.done():
            task.runner.cancel()

    def _find(self, owner: str, task_id: str) -> CallTask:
        task = self._tasks.get(task_id)
        if task is None or task.owner != owner:  # another token's task is not found either
            raise MCPError(INVALID_PARAMS, "task not found (unknown, expired, or another token's)")
        return task

    def get(self, owner: str, task_id: str) -> dict[str, Any]:
        """`tasks/get`: the task's state; MCPError INVALID_PARAMS for an unknown task."""
        return self._find(owner, task_id).view()

    def update(self, owner: str, task_id: str, responses: dict[str, Any]) -> None:
        """`tasks/update`: answers to open questions by key (others ignored)."""
        task = self._find(owner, task_id)
        for key, answer in responses.items():
            waiter = task.waiting.get(key)
            if waiter is None or waiter.done():
                continue
            if isinstance(answer, dict) and answer.get("action") in ("accept", "decline", "cancel"):
                waiter.set_result({"action": answer["action"], "content": answer.get("content")})
            else:
                waiter.set_result({"action": "cancel", "content": None})

    def cancel(self, owner: str, task_id: str) -> None:
        """`tasks/cancel`: the device call is cancelled if it still runs."""
        task = self._find(owner, task_id)
        if task.runner is not None and not task.runner.done():
            task.runner.cancel(f"task {task_id[:8]} cancelled by the client")

    def close(self) -> None:
        for task_id in list(self._tasks):
            self._drop(task_id)

