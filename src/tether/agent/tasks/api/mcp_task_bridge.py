"""`run_task` as a task of MCP's tasks extension: the tether task itself, seen through `ToolTasks`.

The gateway (server/mcp/handlers/tool_tasks.py) speaks the protocol and keeps which token created the task;
this says what the task is, with the rules of the task tools (mcp_tools.py):

- `start`: the task is created exactly as `run_task` creates it (same checks, asker, confirm rule); its
  tether id is the MCP `taskId`.
- `view`: `working` while it plans or runs; `input_required` while it waits for an answer this caller may
  give through its client (the client declared elicitation; an approval only from a person's token with
  `approve`, as `run_task` asks it), the question in `inputRequests` under `q-QUESTION_ID` (a task's own
  question) or `mcp-QUESTION_ID` (an external MCP server's during a step); a question this caller may not
  answer keeps the task `working` with a `statusMessage` saying it waits for a person and how a person
  answers. Once ended: `completed` with `run_task`'s own reply (a failed task's reply has `isError: true`, as
  the extension wants for a tool-level failure), or `cancelled`.
- `answer`: as `answer_task` and `run_task`'s elicitation answer (`accept` with `{"answer": OPTION}`;
  `decline` of an approval denies it; `cancel` leaves the question open); a refused answer is `TaskRefused`.
- `cancel`: as `cancel_task` and `tether cancel` (the task's branches stop, their commands killed on the
  devices), here or on the cluster node running it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette

from tether.agent.planning.plan import Plan
from tether.agent.run.replies import APPROVAL_KINDS
from tether.agent.run.task import Task, TaskState
from tether.agent.tasks.api.mcp_replies import (
    _may_answer_server,
    _may_not_approve,
    _ref,
    _refused,
    _reply,
    _who,
    summary,
)
from tether.agent.tasks.api.mcp_tools import _answer
from tether.agent.tasks.api.task_api import Answer, TaskRequest, _stricter
from tether.agent.tasks.service import TaskError, TaskService
from tether.server.mcp.contributed import GatewayCall, GatewayReply, GatewayTool, TaskRefused, TaskView

QUESTION = "q-"  # inputRequests key of the task's own question: q-QUESTION_ID
SERVER_QUESTION = "mcp-"  # of an external MCP server's question during a step: mcp-QUESTION_ID


def with_tasks(app: Starlette, tools: list[GatewayTool]) -> list[GatewayTool]:
    """`tools` (the task tools of mcp_tools.task_tools) with `run_task` runnable as an MCP task."""

    def service() -> TaskService:
        tasks: TaskService | None = getattr(app.state, "tasks", None)
        if tasks is None:
            raise TaskError(503, "tasks are not running on this server yet")
        return tasks

    bridge = RunTaskTasks(service, lambda: getattr(app.state, "settings", None))
    return [replace(t, tasks=bridge) if t.name == "run_task" else t for t in tools]


class RunTaskTasks:
    """`ToolTasks` for `run_task`; `service()` gives the running TaskService (TaskError 503 before it starts),
    `settings()` the server's settings."""

    def __init__(self, service: Callable[[], TaskService], settings: Callable[[], Any]) -> None:
        self.service, self.settings = service, settings

    async def start(self, arguments: dict[str, Any], call: GatewayCall) -> str | GatewayReply:
        try:
            body = TaskRequest.model_validate(arguments)
        except ValidationError as exc:
            return _refused("run_task", exc)
        if not body.request and not body.plan:
            return GatewayReply("run_task: give `request` (what to do, in plain words) or `plan` (a list of steps), "
                                "at least one", is_error=True)
        try:
            task = await self.service().create(
                body.request, plan=Plan(steps=body.plan) if body.plan else None, device=body.device,
                requires=body.requires, devices=body.devices, requested_by=_who(call),
                confirm=_stricter(call.token.confirm, body.confirm), token=call.token)
        except TaskError as exc:
            return GatewayReply(str(exc), is_error=True)
        return task.id

    async def view(self, task_id: str, call: GatewayCall) -> TaskView:
        tasks = self.service()
        task = await self._task(task_id)
        if task.state is TaskState.CANCELLED:
            return TaskView("cancelled", task.error or "cancelled", reply=_reply(task, call, self.settings()))
        if task.state.terminal or task.state is TaskState.INTERRUPTED:
            return TaskView("completed", f"task {task.state.value}", reply=_reply(task, call, self.settings()))
        shown = summary(task, call, self.settings())
        pending = task.pending_question
        if task.state is TaskState.WAITING_FOR_USER and pending is not None:
            if call.elicit is not None and not (pending.kind in APPROVAL_KINDS and self._may_not_approve(call, task)):
                options = [str(o) for o in pending.options]
                answer: dict[str, Any] = {"type": "string", "title": "answer", **({"enum": options} if options else {})}
                return TaskView("input_required", pending.question[:500], {QUESTION + pending.id: (
                    f"Task {task.id[:12]} on {task.device}: {pending.question}",
                    {"type": "object", "properties": {"answer": answer}, "required": ["answer"]})})
            return TaskView("working", f"waiting for a person: {pending.question[:300]}; to answer, "
                                       f"{shown['how_to_answer']}")
        question = tasks.mcp_question(task.id) if tasks.is_running_here(task.id) else None
        if question is not None and call.elicit is not None and self._may_answer_server(call, task, question):
            asked = question.get("schema")
            return TaskView("input_required", str(question.get("message") or "")[:500], {
                SERVER_QUESTION + str(question.get("id")): (str(question.get("message") or "An MCP server asks"),
                                                            asked if isinstance(asked, dict) else
                                                            {"type": "object", "properties": {}})})
        running = [s for s in shown["steps"] if s["status"] == "running"]
        return TaskView("working", f"task {task.state.value}" + (
            f": step {running[0]['index'] + 1} {running[0]['description'] or running[0]['skill']}" if running else ""))

    async def answer(self, task_id: str, key: str, response: dict[str, Any], call: GatewayCall) -> None:
        tasks = self.service()
        task = await self._task(task_id)
        action, content = response.get("action"), response.get("content") or {}
        try:
            if key.startswith(SERVER_QUESTION):
                question = tasks.mcp_question(task.id) if tasks.is_running_here(task.id) else None
                if question is None or SERVER_QUESTION + str(question.get("id")) != key:
                    return  # not open now: ignored, as the extension says
                _may_answer_server(call, task, question, self.settings())
                text = json.dumps(content) if action == "accept" else str(action or "cancel")
                await tasks.answer_mcp_question(task.id, text, _who(call), answerer=_ref(call))
                return
            pending = task.pending_question
            if pending is None or key != QUESTION + pending.id or task.state is not TaskState.WAITING_FOR_USER:
                return
            if action == "accept" and isinstance(content, dict) and isinstance(content.get("answer"), str) \
                    and content["answer"].strip():
                body = Answer(answer=content["answer"], question_id=pending.id)
                body.digest = pending.digest if pending.kind in APPROVAL_KINDS else None
                await _answer(tasks, task.id, body, call, self.settings())
            elif action == "decline" and pending.kind in APPROVAL_KINDS:  # a denial: anyone may say no
                await tasks.steer(task.id, "approve", _who(call), approved=False, digest=pending.digest,
                                  question_id=pending.id)
        except TaskError as exc:
            raise TaskRefused(str(exc)) from None

    async def cancel(self, task_id: str, call: GatewayCall) -> None:
        task = await self._task(task_id)
        if task.state.terminal:
            return
        try:
            await self.service().steer(task.id, "cancel", _who(call))
        except TaskError as exc:
            if exc.status != 409:  # 409: it ended meanwhile
                raise TaskRefused(str(exc)) from None

    async def changes(self, task_id: str) -> AsyncIterator[None]:
        tasks = self.service()
        found = await tasks.fetch(task_id)
        _, _, queue = tasks.subscribe(task_id, found=found)
        if queue is None:
            return
        try:
            while await queue.get() is not None:
                yield None
        finally:
            tasks.unsubscribe(task_id, queue)

    async def _task(self, task_id: str) -> Task:
        try:
            return await self.service().fetch(task_id)
        except TaskError as exc:
            raise TaskRefused(str(exc)) from None

    def _may_not_approve(self, call: GatewayCall, task: Task) -> bool:
        return _may_not_approve(call, task, self.settings())

    def _may_answer_server(self, call: GatewayCall, task: Task, question: dict[str, Any]) -> bool:
        try:
            _may_answer_server(call, task, question, self.settings())
        except TaskError:
            return False
        return True
