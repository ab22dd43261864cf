"""The task tools of the MCP gateway: `run_task`, `get_task`, `answer_task`, `cancel_task`, `undo_task`.

They are the task API (agent/tasks/api/task_api.py) spoken as MCP tools, on the same TaskService and with the same
scopes, so a desktop or IDE agent reaches tasks with nothing but its MCP client. `run_task` follows the
task the way the REST event stream does and turns each step and its output into a progress notification.
A question is asked through the client's elicitation when it can answer; an approval (an action to approve,
a plan to confirm, an external MCP server's question) only when the token is a person's holding `approve`:
an agent's token never approves, through answer_task or through elicitation (its client answering would be
the agent approving itself). Otherwise the call returns at once with the question and how a person answers
it (the dashboard, the CLI): a tool call must never hang on a person nobody is going to ask.
See docs/security/approvals.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette

from tether.agent.planning.plan import Plan
from tether.agent.run.replies import APPROVAL_KINDS, says_no
from tether.agent.run.task import Task, TaskEvent
from tether.agent.tasks.api.mcp_replies import (
    SUMMARY_SCHEMA,
    _ending_reply,
    _may_answer_server,
    _may_not_approve,
    _need_approve,
    _ref,
    _refused,
    _reply,
    _task_id,
    _who,
)
from tether.agent.tasks.api.task_api import Answer, EditRequest, TaskRequest, _stricter, visible_task
from tether.agent.tasks.service import TaskError, TaskService, judged_question
from tether.server.mcp.contributed import GatewayCall, GatewayReply, GatewayTool

logger = logging.getLogger(__name__)

MAX_PROGRESS_TEXT = 2_000  # one progress message: a line of output, not a whole log

_TASK_ID = {"type": "string", "minLength": 1, "maxLength": 64, "description": "the task's id (or a unique prefix)"}


UNDO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"task_id": {"type": "string"},
                   "devices": {"type": "object", "description": "per device: what was restored, or the error"}},
    "required": ["task_id", "devices"],
}


def _run_input() -> dict[str, Any]:
    """TaskRequest's schema as one object without a top-level `anyOf` (which Anthropic's API, and so every
    Claude-based client, refuses): "`request` or `plan`, at least one" is said in the descriptions, and checked
    when the task is created (TaskService.create: a tool error naming both)."""
    schema = TaskRequest.model_json_schema()
    schema.pop("title", None)
    schema.pop("anyOf", None)
    properties = schema["properties"]
    properties["request"]["description"] = ("what to do, in plain words (planned by the server's LLM); give this "
                                            "or `plan`, at least one")
    properties["plan"]["description"] = ("a plan to run as given (no LLM needed): at least one step; give this "
                                         "or `request`, at least one")
    schema["description"] = "Give `request` (plain words) or `plan` (steps), at least one; the rest is optional."
    return schema


EDIT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"task": {"type": "string"},
                   "status": {"type": "string", "description": "applied, or waiting_for_confirmation (a person's)"},
                   "step_states": {"type": "array", "items": {"type": "string"}}},
    "required": ["task", "status", "step_states"],
}


def _edit_input() -> dict[str, Any]:
    """EditRequest's schema with the task's id: one object, no top-level `anyOf`/`oneOf`."""
    schema = EditRequest.model_json_schema()
    schema.pop("title", None)
    schema["properties"] = {"task_id": _TASK_ID, **schema["properties"]}
    schema["required"] = ["task_id"]
    schema["additionalProperties"] = False
    return schema


ANSWER_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "task_id": _TASK_ID,
        "answer": {"type": "string", "maxLength": 10_000,
                   "description": "an option (its text or number) or free words"},
        "approved": {"type": "boolean", "description": "for an approval: true approves, false denies (and "
                                                      "cancels the task)"},
        "question_id": {"type": "string", "description": "the question answered; refused if not the open one"},
        "digest": {"type": "string", "maxLength": 100, "description": "the question's digest as it was shown; "
                                                                      "refused if what waits is no longer that"},
        "wait": {"type": "boolean", "default": True,
                 "description": "follow the task after answering, as run_task does, until it ends or asks again"},
    },
    "required": ["task_id"],
    "additionalProperties": False,
}

_ID_ONLY: dict[str, Any] = {"type": "object", "properties": {"task_id": _TASK_ID}, "required": ["task_id"],
                            "additionalProperties": False}


def task_tools(app: Starlette) -> list[GatewayTool]:
    """The task tools for `app`'s gateway; each looks the TaskService up when called (it starts later)."""

    def settings() -> Any:
        return getattr(app.state, "settings", None)

    def service() -> TaskService:
        tasks: TaskService | None = getattr(app.state, "tasks", None)
        if tasks is None:
            raise TaskError(503, "tasks are not running on this server yet")
        return tasks

    async def run_task(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        try:
            body = TaskRequest.model_validate(arguments)
        except ValidationError as exc:
            return _refused("run_task", exc)
        if not body.request and not body.plan:  # the schema's one rule it no longer states as a combinator
            return GatewayReply("run_task: give `request` (what to do, in plain words) or `plan` (a list of steps), "
                                "at least one", is_error=True)
        tasks = service()
        task = await tasks.create(body.request, plan=Plan(steps=body.plan) if body.plan else None,
                                  device=body.device, requires=body.requires, devices=body.devices,
                                  requested_by=_who(call), confirm=_stricter(call.token.confirm, body.confirm),
                                  token=call.token)
        return await _follow(tasks, task.id, call, settings=settings())

    async def get_task(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        task = await service().fetch(_task_id(arguments))
        return _ending_reply(service(), task, call, settings()) or _reply(task, call, settings())

    async def answer_task(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        unknown = set(arguments) - set(ANSWER_INPUT["properties"])
        if unknown:
            return GatewayReply(f"answer_task: unknown argument(s) {', '.join(sorted(unknown))}", is_error=True)
        tasks = service()
        task_id = (await tasks.fetch(_task_id(arguments))).id
        asked = (await tasks.fetch(task_id)).pending_question
        approved = arguments.get("approved")
        if approved is not None and not isinstance(approved, bool):
            return GatewayReply("answer_task: 'approved' must be true or false", is_error=True)
        if approved is None:
            try:
                body = Answer.model_validate({k: arguments[k] for k in ("answer", "question_id") if k in arguments})
            except ValidationError as exc:
                return _refused("answer_task", exc, hint="give 'answer' (an option or words) or 'approved'")
            body.digest = arguments.get("digest") if isinstance(arguments.get("digest"), str) else None
            await _answer(tasks, task_id, body, call, settings())
        else:
            if approved:  # a denial stops the action: an agent may always say no
                _need_approve(call, f"approve task {task_id[:12]}'s action", await tasks.fetch(task_id), settings())
            await tasks.steer(task_id, "approve", _who(call), approved=approved,  # (on the node running it)
                              digest=arguments.get("digest") if isinstance(arguments.get("digest"), str) else None,
                              question_id=judged_question(asked, None))
        await asyncio.sleep(0)  # as the REST answer: the waiting runner takes the answer first
        if arguments.get("wait", True) is False:
            return _reply(await tasks.fetch(task_id), call, settings())
        return await _follow(tasks, task_id, call, answered=asked.id if asked is not None else None,
                             settings=settings())

    async def cancel_task(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        tasks = service()
        task_id = (await tasks.fetch(_task_id(arguments))).id
        await tasks.steer(task_id, "cancel", _who(call))  # here, or on the node of the cluster running it
        return _reply(await tasks.fetch(task_id), call, settings())

    async def undo_task(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        tasks = service()
        task = await tasks.fetch(_task_id(arguments))
        _need_approve(call, "undo a task (it rewrites files as an approved action)", task, settings(), undo=True)
        report = await tasks.undo(task.id, _who(call))
        lines = [f"{name}: " + (f"restored {info['restored']}" if "restored" in info else f"error: {info['error']}")
                 for name, info in report.items()] or ["the task changed nothing on any device"]
        failed = any("error" in info for info in report.values())
        return GatewayReply(f"undo of task {task.id}:\n" + "\n".join(lines),
                            {"task_id": task.id, "devices": report}, is_error=failed)

    async def edit_task(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
        from tether.agent.planning.edits import GraphEdit
        from tether.agent.tasks.graph_edit import GraphEditRefused, edit_graph

        try:
            body = EditRequest.model_validate({k: v for k, v in arguments.items() if k != "task_id"})
        except ValidationError as exc:
            return _refused("edit_task", exc)
        if not (body.add or body.remove or body.add_needs):
            return GatewayReply("edit_task: the edit is empty: give add, remove or add_needs", is_error=True)
        tasks = service()
        task_id = (await tasks.fetch(_task_id(arguments))).id
        try:
            done = await edit_graph(tasks, task_id, GraphEdit(add=body.add, remove=body.remove,
                                                              add_needs=body.add_needs), call.token, _who(call))
        except GraphEditRefused as exc:
            return GatewayReply(str(exc), {"reasons": exc.reasons}, is_error=True)
        told = ("applied" if done["status"] == "applied" else
                "waiting for a person to confirm the new steps (the task's confirm mode asks for it)")
        return GatewayReply(f"edit of task {task_id}: {told}; steps now: " + ", ".join(
            f"{i + 1} {state}" for i, state in enumerate(done["step_states"])), done)

    def guarded(handler: Any) -> Any:
        async def run(arguments: dict[str, Any], call: GatewayCall) -> GatewayReply:
            try:
                if "task_id" in arguments and call.token.scoped:  # another scope's task is not there for it
                    await visible_task(service(), _task_id(arguments), call.token)
                return await handler(arguments, call)
            except TaskError as exc:  # the REST API's {"error"} as a tool error, same words
                return GatewayReply(str(exc), is_error=True)

        return run

    return [
        GatewayTool("run_task", "Run a task on the fleet: a request in plain words (planned by the server's LLM) "
                    "or a plan of steps, on a device or one meeting `requires`. Reports each step and its output "
                    "as progress; asks questions and approvals through the client when it can, otherwise returns "
                    "the question at once (answer it with answer_task). Returns the answer and a summary.",
                    _run_input(), "execute", guarded(run_task), SUMMARY_SCHEMA, destructive=True),
        GatewayTool("get_task", "A task's status, its steps and the question it is waiting on, if any.",
                    _ID_ONLY, "read", guarded(get_task), SUMMARY_SCHEMA, read_only=True),
        GatewayTool("answer_task", "Answer the question a task is waiting on (an option or words), or deny its "
                    "action (`approved: false`). Approving (an action, a plan to run, an MCP server's question) is "
                    "a person's: an agent's token is refused and told how a person approves. Then follows the task "
                    "like run_task.",
                    ANSWER_INPUT, "execute", guarded(answer_task), SUMMARY_SCHEMA),
        GatewayTool("edit_task", "Edit a running graph task: add steps (a step's `needs` names the steps it waits "
                    "for), remove steps that have not started, add needs to steps that have not started. Checked "
                    "against the whole graph and applied at once, or refused with every reason. New steps from an "
                    "agent wait for a person's confirmation when the task's confirm mode asks for it.",
                    _edit_input(), "execute", guarded(edit_task), EDIT_SCHEMA, destructive=True),
        GatewayTool("cancel_task", "Cancel a task: its running command is stopped on the device.",
                    _ID_ONLY, "execute", guarded(cancel_task), SUMMARY_SCHEMA, destructive=True),
        GatewayTool("undo_task", "Put back the files a finished task changed, on every device it ran on (needs "
                    "the approve scope).", _ID_ONLY, "execute", guarded(undo_task), UNDO_SCHEMA, destructive=True),
    ]


# -- following a task ---------------------------------------------------------------------------------


async def _follow(tasks: TaskService, task_id: str, call: GatewayCall, answered: str | None = None,
                  settings: Any = None) -> GatewayReply:
    """Follow the task from now on until it ends, or asks something this client cannot answer here.
    `answered` is the question just answered (its runner may not have taken the answer yet)."""
    found = await tasks.fetch(task_id)  # off the event loop when not in memory
    task, _, queue = tasks.subscribe(task_id, found=found)  # what happened before is in get_task; from now on here
    sent = 0
    try:
        # asked before we subscribed and still open; one not saved yet is not: its event comes on the queue
        pending = task.pending_question
        if pending is not None and pending.id != answered and queue is not None and tasks.asked(task, pending.id) \
                and not await _ask(tasks, task, pending.model_dump(mode="json"), call, settings):
            return _reply(task, call, settings)
        while queue is not None:
            event = await queue.get()
            if event is None:
                break
            message = _progress_text(task, event)
            if message is not None:
                sent += 1
                await _progress(call, sent, message)
            if event.kind == "question" and not await _ask(tasks, task, event.data, call, settings):
                return _reply(task, call, settings)
            if event.kind == "elicitation" and "id" in event.data and "declined" not in event.data \
                    and not await _ask_for_server(tasks, task, event.data, call, settings):
                return _reply(task, call, settings)
    except asyncio.CancelledError:
        # the client cancelled its call: the task stops too (its command killed on the device), as a
        # cancelled REST command does; an ended task is left as it is
        if not task.state.terminal:
            await asyncio.shield(_cancel_quietly(tasks, task.id))
        raise
    finally:
        if queue is not None:
            tasks.unsubscribe(task.id, queue)
    return _ending_reply(tasks, task, call, settings) or _reply(task, call, settings)


async def _cancel_quietly(tasks: TaskService, task_id: str) -> None:
    try:
        await tasks.cancel(task_id)
    except TaskError as exc:
        logger.info("MCP gateway: task %s not cancelled with its call: %s", task_id, exc)


async def _progress(call: GatewayCall, sent: int, message: str) -> None:
    try:
        await call.progress(float(sent), None, message[:MAX_PROGRESS_TEXT])
    except Exception as exc:  # a client gone mid-task loses its notifications, not the task
        logger.debug("MCP gateway: task progress not sent: %s", exc)


def _progress_text(task: Task, event: TaskEvent) -> str | None:
    data = event.data
    total = len(task.plan.steps) if task.plan is not None else 0
    step = f"step {int(data.get('step', 0)) + 1}" + (f"/{total}" if total else "")
    if event.kind == "step_started":
        what = data.get("description") or data.get("skill")
        return f"{step} started: {what}" + (f" on {data['device']}" if data.get("device") else "")
    if event.kind == "step_finished":
        return f"{step} {data.get('status')}" + (f": {data['error']}" if data.get("error") else "")
    if event.kind == "output" and isinstance(data.get("data"), str):
        return f"{step} output: {data['data']}"
    if event.kind == "question":
        return f"waiting for an answer: {data.get('question')}"
    if event.kind == "state":
        return f"task {data.get('to')}"
    return None


async def _ask(tasks: TaskService, task: Task, question: dict[str, Any], call: GatewayCall,
               settings: Any = None) -> bool:
    """Ask the task's question through the client; False when it cannot be asked or was not answered,
    and the call should return with the question open. An approval (or a plan to confirm) is asked only
    of a person's token that may give it: an agent's client answering would be the agent approving itself."""
    approval = question.get("kind") in APPROVAL_KINDS
    if call.elicit is None or (approval and _may_not_approve(call, task, settings)):
        return False
    options = [str(o) for o in question.get("options") or []]
    prop: dict[str, Any] = {"type": "string", "title": "answer"}
    if options:
        prop["enum"] = options
    schema = {"type": "object", "properties": {"answer": prop}, "required": ["answer"]}
    try:
        reply = await call.elicit(f"Task {task.id[:12]} on {task.device}: {question.get('question')}", schema)
    except Exception as exc:  # a client that fails or takes too long to answer leaves the question open
        logger.info("MCP gateway: task %s question not asked through the client: %s", task.id, exc)
        return False
    action = reply.get("action")
    content = reply.get("content") or {}
    try:
        # as through the API: taken once saved (`steer_here`; a TaskError when it cannot be, logged below)
        if action == "accept" and isinstance(content.get("answer"), str) and content["answer"].strip():
            await tasks.steer_here(task.id, "answer", _who(call), {
                "answer": content["answer"], "question_id": question.get("id"),
                "digest": question.get("digest") if approval else None})
        elif action == "decline" and approval:  # a person said no: a denial, as through the API
            await tasks.steer_here(task.id, "approve", _who(call), {"approved": False})
        else:
            return False
    except TaskError as exc:
        logger.info("MCP gateway: task %s answer not taken: %s", task.id, exc)
        return False
    return True


async def _ask_for_server(tasks: TaskService, task: Task, question: dict[str, Any], call: GatewayCall,
                          settings: Any = None) -> bool:
    """An external MCP server's question during a step, asked through this client with its own schema; as
    POST /devices/{name}/questions/{id}, only of a person's token that may answer it."""
    if call.elicit is None:
        return False
    try:
        _may_answer_server(call, task, question, settings)
    except TaskError:  # not this caller's to answer: it waits for the person who may
        return False
    asked = question.get("schema")
    schema: dict[str, Any] = asked if isinstance(asked, dict) else {"type": "object", "properties": {}}
    try:
        reply = await call.elicit(str(question.get("message") or "An MCP server asks"), schema)
        action = reply.get("action")
        content = reply.get("content") or {}
        text = json.dumps(content) if action == "accept" else str(action or "cancel")
        return await tasks.answer_mcp_question(task.id, text, _who(call), answerer=_ref(call))
    except Exception as exc:
        logger.info("MCP gateway: task %s server question not asked through the client: %s", task.id, exc)
        return False


async def _answer(tasks: TaskService, task_id: str, body: Answer, call: GatewayCall, settings: Any) -> None:
    """As POST /tasks/{id}/answer: an MCP server's open question, else the task's own question."""
    task = await tasks.fetch(task_id)
    pending = task.pending_question
    question = tasks.mcp_question(task_id)
    if pending is None and question is not None:
        _may_answer_server(call, task, question, settings)
        await tasks.answer_mcp_question(task_id, body.answer, _who(call), answerer=_ref(call))
        return
    judged = judged_question(pending, body.question_id)  # applied to this question only, wherever the task runs
    if pending is not None and pending.kind in APPROVAL_KINDS and not says_no(body.answer, pending.options):
        _need_approve(call, f"answer task {task_id[:12]}'s {pending.kind}", task, settings)
    await tasks.steer(task_id, "answer", _who(call), answer=body.answer, question_id=judged, digest=body.digest)


# -- replies --------------------------------------------------------------------------------------------
