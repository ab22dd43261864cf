"""The task API under /api/v1/tasks: create, get, list, stream events, answer, approve, cancel, undo, and
edit a running graph (`POST /{id}/edits`, agent/tasks/graph_edit.py).

Creating and steering a task needs the `execute` scope; reading needs `read`; approving, answering
an approval and undoing need `approve`. A task's events stream
as server-sent events (`event: task_event`, data a `TaskEvent`), starting after `?after=SEQ` so a
client that lost the stream picks up where it stopped, and ending with `event: end` once the task
has ended. Errors are `{"error": "..."}` like the rest of the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.run.graph.view import graph_of
from tether.agent.run.replies import APPROVAL_KINDS, says_no
from tether.agent.run.task import Task, TaskEvent, TaskState
from tether.agent.tasks.service import TaskError, TaskService, judged_question
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.batches.ledger import TokenRef
from tether.server.http.api import ERROR_RESPONSES, require, require_approver
from tether.server.store.tokens import TokenInfo
from tether.server.trust.approvals import how_a_person_approves

router = APIRouter(prefix="/api/v1/tasks", tags=["tasks"], responses=ERROR_RESPONSES)
_KEEPALIVE_S = 15.0


class TaskRequest(BaseModel):
    # a request in words or a plan, at least one of them (the document says so for API clients)
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"required": ["plan"], "properties": {"plan": {"type": "array"}}},
        {"required": ["request"], "properties": {"request": {"minLength": 1}}}]})

    request: str = Field("", max_length=20_000, description="what to do, in plain words")
    plan: list[PlanStep] | None = Field(None, min_length=1, description="a plan to run as given (no LLM needed)")
    device: str | None = Field(None, description="the device to run on (else chosen by `requires`)")
    requires: DeviceRequirements | None = None
    devices: list[str] = Field(default_factory=list, description="other devices the planner may use")
    confirm: Literal["never", "destructive", "always"] | None = Field(
        None, description="which plans wait for a person's confirmation; the token's own setting is kept "
                          "when it is stricter")


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answer: str = Field(..., max_length=10_000, description="an option (its text or number) or free words")
    question_id: str | None = Field(None, description="the question answered; refused if it is not the open one")
    digest: str | None = Field(None, max_length=100, description=(
        "the `digest` of the question as you were shown it; refused (409) when what waits for the answer is no "
        "longer that (docs/security/approvals.md)"))


class Approval(BaseModel):
    model_config = ConfigDict(extra="forbid")

    approved: bool
    digest: str | None = Field(None, max_length=100, description=(
        "the `digest` of the approval question as you were shown it; refused (409) when what waits for approval "
        "is no longer that"))
    always: Literal["program", "subcommand"] | None = Field(None, description=(
        "with approved: the 'always' answer to a shell command the device's policy asks about: the program "
        "(or the program with this first argument as its only subcommand) joins the device's allowlist for "
        "good, as an audited policy change (needs the admin scope), then the command runs"))


class EditRequest(BaseModel):
    """An edit of a running graph plan (docs/graphs.md): checked whole, applied at once or refused."""

    model_config = ConfigDict(extra="forbid")

    add: list[PlanStep] = Field(default_factory=list, max_length=100, description=(
        "steps to add, numbered on from the plan's end; a step without `needs` follows the step listed before it "
        "(`needs: []` starts it at once)"))
    remove: list[str] = Field(default_factory=list, max_length=100,
                              description="steps (ids, or numbers from 1) that have not started, to remove")
    add_needs: dict[str, list[str]] = Field(default_factory=dict, description=(
        "a step that has not started (id or number) → more steps it needs"))


_CONFIRM_ORDER = ("never", "destructive", "always")


def _stricter(token: str, asked: str | None) -> str:
    """The stricter of a token's confirmation setting and the one a request asks for."""
    levels = [c for c in (token, asked) if c in _CONFIRM_ORDER]
    return max(levels, key=_CONFIRM_ORDER.index) if levels else "never"


def _service(request: Request) -> TaskService:
    return request.app.state.tasks


async def visible_task(service: TaskService, task_id: str, who: TokenInfo) -> Task:
    """The task, when `who` may see it (`TaskService.visible`); else the 404 a task that does not exist gets,
    naming the token's scope: a scoped token cannot read, follow, answer or steer another scope's task."""
    task = await service.fetch(task_id)
    if not service.visible(task, who):
        raise TaskError(404, f"no task '{task_id[:64]}' on the devices in the scope of token '{who.name}' "
                             f"({who.scope_text()})")
    return task
def _settings(request: Request) -> Any:
    return getattr(request.app.state, "settings", None)


async def task_error(request: Request, exc: Exception) -> JSONResponse:
    """Every `TaskError` the service raises becomes the API's `{"error": ...}` with its status."""
    assert isinstance(exc, TaskError)
    return JSONResponse({"error": str(exc)}, status_code=exc.status)


@router.post("", status_code=201)
async def create_task(body: TaskRequest, request: Request,
                      who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Create a task and start it; follow it with GET /tasks/{id}/events."""
    plan = Plan(steps=body.plan) if body.plan else None
    task = await _service(request).create(body.request, plan=plan, device=body.device, requires=body.requires,
                                          devices=body.devices, requested_by=f"api:{who.name}",
                                          confirm=_stricter(who.confirm, body.confirm), token=who)
    return task.summary()


@router.post("/dry-run")
async def dry_run_task(body: TaskRequest, request: Request,
                       who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Plan the request (or check the plan) for the device it would run on, and run nothing: the plan, the
    device and the problems that would stop it (none when it would run). Nothing is stored."""
    plan = Plan(steps=body.plan) if body.plan else None
    device, planned, problems = await _service(request).dry_run(body.request, plan=plan, device=body.device,
                                                                requires=body.requires, devices=body.devices,
                                                                token=who)
    return {"device": device, "plan": [s.model_dump(mode="json") for s in planned], "problems": problems}


@router.get("")
async def list_tasks(request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
                     limit: Annotated[int, Query(ge=1, description="at most 1000")] = 50,
                     state: TaskState | None = None) -> list[dict[str, Any]]:
    """Newest first; a scoped token sees the tasks of its devices only (a page may come out short). `state`: one
    of `TaskState`'s values (another is a 422 naming them, never an empty list)."""
    service = _service(request)
    rows = await service.listing(max(1, min(limit, 1000)), state.value if state else None)
    if not who.scoped:
        return rows
    kept = []
    for row in rows:
        with contextlib.suppress(TaskError):
            if service.visible(await service.fetch(row["id"]), who):
                kept.append(row)
    return kept


@router.get("/{task_id}")
async def get_task(task_id: str, request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
                   events: bool = True) -> dict[str, Any]:
    """The whole task: plan, every step with its command and result, decisions, questions, events."""
    task: Task = await visible_task(_service(request), task_id, who)
    body = task.model_dump(mode="json", exclude={"events"} if not events else None)
    body["graph"] = graph_of(task)  # a graph plan's steps, states and stages (None for a list plan)
    return _service(request).shown(task, body)  # an end not saved yet is not shown (`ending` says why)


@router.post("/{task_id}/answer")
async def answer_task(task_id: str, body: Answer, request: Request,
                      who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Answer the open question; the same task resumes where it stopped. Answering an approval
    question needs the `approve` scope, as /approval does."""
    service = _service(request)
    task = await visible_task(service, task_id, who)
    pending = task.pending_question
    base = str(request.base_url)
    if pending is None and service.mcp_question(task_id) is not None:  # an MCP server asks, mid-step
        # as POST /devices/{name}/questions/{id}: an answer lets a tool go on as a person chose, and the
        # question is the task's asker's (the hub checks who may answer it: approvals.check_answerer); a task
        # that recorded no asker keeps four-eyes on who created it
        require_approver(who, "answer an MCP server's question", how_a_person_approves(
            base, task_id=task.id, question="mcp"), requested_by=task.requested_by if task.asker is None else None,
            settings=_settings(request))
        await service.answer_mcp_question(task_id, body.answer, f"api:{who.name}",
                                          answerer=TokenRef(who.name, who.agent))
        return (await service.fetch(task_id)).summary()
    judged = judged_question(pending, body.question_id)  # applied to this question only, wherever the task runs
    if pending is not None and pending.kind in APPROVAL_KINDS and not says_no(body.answer, pending.options):
        require_approver(who, f"answer task {task.id[:12]}'s {pending.kind}", how_a_person_approves(
            base, task_id=task.id), requested_by=task.requested_by, settings=_settings(request))
    return _summary(await service.steer(task_id, "answer", f"api:{who.name}", answer=body.answer,
                                        question_id=judged, digest=body.digest))


@router.post("/{task_id}/approval")
async def approve_task(task_id: str, body: Approval, request: Request,
                       who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Approve or deny the action the task is waiting on (a denial cancels the task). Needs the
    `approve` scope: an agent holding an execute token must not approve its own actions."""
    task = await visible_task(_service(request), task_id, who)
    if body.approved:  # a denial stops the action: an agent may always say no (as it may cancel)
        require_approver(who, f"approve task {task.id[:12]}'s action", how_a_person_approves(
            str(request.base_url), task_id=task.id), requested_by=task.requested_by, settings=_settings(request))
    if body.always is not None and body.approved:  # a denial is a denial, whatever else it says
        await _allow_always(request, task_id, body, who)
    return _summary(await _service(request).steer(task_id, "approve", f"api:{who.name}", approved=body.approved,
                                                  digest=body.digest,
                                                  question_id=judged_question(task.pending_question, None)))


@router.post("/{task_id}/cancel")
async def cancel_task(task_id: str, request: Request,
                      who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    await visible_task(_service(request), task_id, who)
    return _summary(await _service(request).steer(task_id, "cancel", f"api:{who.name}"))


def _summary(task: Task | dict[str, Any]) -> dict[str, Any]:
    """A task's summary: made here, or by the node of the cluster that runs the task."""
    return task if isinstance(task, dict) else task.summary()


@router.post("/{task_id}/undo")
async def undo_task(task_id: str, request: Request,
                    who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Put back the files the task's commands changed, on each device they ran on. Needs the `approve`
    scope: the undo rewrites files as an approved action (the device refuses it otherwise), so an
    agent's execute token must not be able to set it off."""
    await visible_task(_service(request), task_id, who)
    require_approver(who, "undo a task (it rewrites files as an approved action)",
                     how_a_person_approves(str(request.base_url), task_id=task_id, undo=True))
    return {"task": task_id, "devices": await _service(request).undo(task_id, f"api:{who.name}")}


@router.post("/{task_id}/edits")
async def edit_task(task_id: str, body: EditRequest, request: Request,
                    who: Annotated[TokenInfo, Depends(require("execute"))]) -> dict[str, Any]:
    """Edit the running graph: add steps, remove steps that have not started, add needs. Checked against the
    whole graph and applied at once (an `edit` event), or refused with every reason (409 when it changes steps
    that have started, else 422: `{"error"}` naming every reason; an `edit_refused` event). Needs `execute` on every
    device the edit touches; an agent's new steps wait for a person when the task's confirm mode says so."""
    from tether.agent.planning.edits import GraphEdit
    from tether.agent.tasks.graph_edit import edit_graph

    await visible_task(_service(request), task_id, who)
    if not (body.add or body.remove or body.add_needs):
        raise TaskError(422, "the edit is empty: give add, remove or add_needs")
    edit = GraphEdit(add=body.add, remove=body.remove, add_needs=body.add_needs)
    return await edit_graph(_service(request), task_id, edit, who, f"api:{who.name}")  # refused: TaskError


@router.get("/{task_id}/events", responses={200: {"content": {"text/event-stream": {}}}})
async def task_events(task_id: str, request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
                      after: int = -1) -> StreamingResponse:
    service = _service(request)
    found = await visible_task(service, task_id, who)
    task, past, queue = service.subscribe(task_id, after, found)
    return StreamingResponse(_stream(service, task, past, queue), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


async def _stream(service: TaskService, task: Task, past: list[TaskEvent],
                  queue: asyncio.Queue[TaskEvent | None] | None) -> AsyncIterator[bytes]:
    try:
        last = -1
        for event in past:
            last = event.seq
            yield _frame("task_event", event.model_dump(mode="json"))
        while queue is not None:
            try:
                coming = await asyncio.wait_for(queue.get(), _KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"  # proxies drop silent streams; a waiting task can be silent for long
                continue
            if coming is None:
                break
            if coming.seq <= last:  # in a cluster, relayed while the stored ones were read: sent already
                continue
            last = coming.seq
            yield _frame("task_event", coming.model_dump(mode="json"))
        # `ended` is false when the server is shutting down under a task that is still going
        if not task.state.terminal:  # a task another node of a cluster ran: its stored end
            with contextlib.suppress(TaskError):
                task = await service.fetch(task.id)
        yield _frame("end", service.end_of(task))  # a task whose end is not saved yet: not ended (`ending`)
    finally:
        if queue is not None:
            service.unsubscribe(task.id, queue)


async def _allow_always(request: Request, task_id: str, body: Approval, who: TokenInfo) -> None:
    """Add the waiting shell command's program (or program + first argument) to its device's allowlist."""
    from tether.server.aip import policy_push

    if not who.allows("admin"):
        raise HTTPException(403, f"token '{who.name}' lacks the 'admin' scope an 'always' answer needs (it "
                                 "changes the device's policy); approve once, or ask an admin")
    service = _service(request)
    try:
        task = await service.fetch(task_id)
    except TaskError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    pending = task.pending_question
    record = next((r for r in reversed(task.steps) if pending is not None and r.index == pending.step), None)
    if pending is None or pending.kind != "approval" or record is None:
        raise HTTPException(409, f"task {task.id} has no command waiting for approval")
    command = record.command
    if command.tool_name not in ("shell.run", "shell_execute", "shell_execute_read"):
        raise HTTPException(422, f"'always' is for shell commands; this approval is for {command.tool_name}")
    params = command.parameters or {}
    program = str(params.get("cmd") or "").rsplit("/", 1)[-1]
    argv = params.get("argv") or params.get("args") or []
    first = next((a for a in argv if isinstance(a, str) and not a.startswith("-")), None)
    if not program:
        raise HTTPException(422, "the waiting command names no program (cmd)")
    if body.always == "subcommand" and first is None:
        raise HTTPException(422, "'always subcommand' needs a first argument that is not an option")
    device = record.step.device or task.device
    if device is None:
        raise HTTPException(409, "the waiting command's device is not known")
    rule: dict[str, Any] = {"subcommands": [first]} if body.always == "subcommand" else {}
    try:
        await policy_push.change(service.hub, device, {"commands": {program: rule}}, replace=False,
                                 requested_by=f"api:{who.name}", audit=request.app.state.store.audit)
    except policy_push.PolicyRequestFailed as exc:
        raise HTTPException(exc.status, f"the device's policy was not changed, nothing approved: {exc}") from None
