"""The task tools' replies and refusals: a task's `summary` as MCP structured content, its text form, and the
checks of who may approve or answer what through the gateway (`approvals.check_*` on the calling token)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tether.agent.run.replies import APPROVAL_KINDS
from tether.agent.run.task import Task
from tether.agent.tasks.service import TaskError, TaskService
from tether.server.aip.batches.ledger import TokenRef
from tether.server.mcp.contributed import GatewayCall, GatewayReply
from tether.server.trust.approvals import (
    ApprovalRefused,
    check_answerer,
    check_approver,
    check_four_eyes,
    how_a_person_approves,
    server_url,
)

MAX_STEP_TEXT = 500  # a step's error in the summary
MAX_ANSWER_TEXT = 100_000  # the answer in a reply (text and structured): a client's context is not a log

SUMMARY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "task_id": {"type": "string"},
        "status": {"type": "string", "description": "created|planning|running|recovering|waiting_for_user|"
                                                    "done|failed|cancelled|interrupted"},
        "device": {"type": ["string", "null"]},
        "steps": {"type": "array", "items": {"type": "object", "properties": {
            "index": {"type": "integer"}, "skill": {"type": "string"}, "description": {"type": "string"},
            "device": {"type": ["string", "null"]}, "status": {"type": "string"},
            "error": {"type": ["string", "null"]}}}},
        "answer": {"type": ["string", "null"]},
        "error": {"type": ["string", "null"]},
        "question": {"type": ["object", "null"], "description": "the open question or approval, if any",
                     "properties": {"id": {"type": "string"}, "question": {"type": "string"},
                                    "options": {"type": "array", "items": {"type": "string"}},
                                    "kind": {"type": "string"}}},
        "how_to_answer": {"type": ["string", "null"]},
    },
    "required": ["task_id", "status", "steps", "answer"],
}


def summary(task: Task, call: GatewayCall | None = None, settings: Any = None) -> dict[str, Any]:
    """The structured summary every task tool returns (SUMMARY_SCHEMA); for a caller that may not approve,
    an approval's `how_to_answer` says how a person approves."""
    steps: list[dict[str, Any]] = []
    for index, step in enumerate(task.plan.steps if task.plan is not None else []):
        records = task.records_for(index)
        last = records[-1] if records else None
        status = last.result.status.value if last is not None else ("running" if index == task.cursor
                                                                     and not task.state.terminal else "pending")
        error = last.result.error if last is not None and last.result.error else None
        steps.append({"index": index, "skill": step.skill, "description": step.description,
                      "device": step.device or task.device, "status": status,
                      "error": error[:MAX_STEP_TEXT] if error else None})
    pending = task.pending_question
    question = None if pending is None else {"id": pending.id, "question": pending.question,
                                             "options": list(pending.options), "kind": pending.kind}
    how = None
    if pending is not None and pending.kind in APPROVAL_KINDS and call is not None and _may_not_approve(call, task,
                                                                                                     settings):
        how = (f"{how_a_person_approves(server_url(settings), task_id=task.id)}; this token may only deny it "
               f"(answer_task with task_id {task.id!r} and approved: false) or cancel the task (cancel_task)")
    elif pending is not None:
        how = (f"call answer_task with task_id {task.id!r} and " + ("approved: true or false (a person's token "
               "with the approve scope)" if pending.kind == "approval" else f"answer: one of {pending.options}"
               if pending.options else "answer: your words"))
    answer = task.answer[:MAX_ANSWER_TEXT] if task.answer else task.answer
    error = task.error[:MAX_ANSWER_TEXT] if task.error else task.error
    return {"task_id": task.id, "status": task.state.value, "device": task.device, "steps": steps,
            "answer": answer, "error": error, "question": question, "how_to_answer": how}


def _reply(task: Task, call: GatewayCall | None = None, settings: Any = None) -> GatewayReply:
    data = summary(task, call, settings)
    if data["question"] is not None:
        text = (f"Task {task.id} is waiting for an answer: {data['question']['question']}\n"
                + (f"Options: {', '.join(data['question']['options'])}\n" if data["question"]["options"] else "")
                + (f"Who asked: {task.requested_by}\n" if task.requested_by else "")
                + f"To answer, {data['how_to_answer']}.")
    elif task.state.value == "done":
        text = data["answer"] or f"Task {task.id} is done."
    elif task.state.terminal:
        text = f"Task {task.id} {task.state.value}" + (f": {data['error']}" if data["error"] else "")
    else:
        text = f"Task {task.id} is {task.state.value}; follow it with get_task."
    return GatewayReply(text, data, is_error=task.state.value == "failed")


def _ending_reply(tasks: TaskService, task: Task, call: GatewayCall | None = None, settings: Any = None
                  ) -> GatewayReply | None:
    """The reply for a task that ended here but whose end is not saved yet (`TaskService.ending`): the task as the
    store holds it, never its end, which a restart might not find; None for any other task."""
    ending = tasks.ending(task.id)
    if ending is None:
        return None
    data = summary(task, call, settings)
    data["status"] = tasks.end_of(task)["state"]
    why = ending["unsaved"] or "the write is under way"
    return GatewayReply(f"Task {task.id} is {data['status']}: it ended here ({ending['state']}) but that is not saved "
                        f"yet ({why}); follow it with get_task.", data)


def _task_id(arguments: dict[str, Any]) -> str:
    value = arguments.get("task_id")
    if not isinstance(value, str) or not value.strip() or len(value) > 64:
        raise TaskError(422, "task_id: give the task's id (or a unique prefix of it)")
    return value.strip()


def _need_approve(call: GatewayCall, what: str, task: Task | None, settings: Any, question: str | None = None,
                  undo: bool = False) -> None:
    """TaskError 403 unless this caller may give the approval: a person's token with `approve` and, with
    four-eyes on, not the token that created the task; the error says how a person approves."""
    how = how_a_person_approves(server_url(settings), task_id=task.id if task is not None else None,
                                question=question, undo=undo)
    try:
        check_approver(call.token, what, how)
        if task is not None and not undo:  # four-eyes is about approving what was asked (REST's undo: the same)
            check_four_eyes(bool(getattr(settings, "four_eyes", False)), task.requested_by, _who(call), what)
    except ApprovalRefused as exc:
        raise TaskError(403, str(exc)) from None


def _may_answer_server(call: GatewayCall, task: Task, question: dict[str, Any], settings: Any) -> None:
    """TaskError 403 unless this caller may answer the question an external MCP server asks during `task`'s
    step: a person's token with `approve`, and the question the task's asker's (`approvals.check_answerer`,
    as for a plain command's: the asker's own, a person for an agent's task, another person for a consent
    question under four-eyes). A task that recorded no asker keeps four-eyes on who created it."""
    what = "answer an MCP server's question"
    if task.asker is None:
        _need_approve(call, what, task, settings, question="mcp")
        return
    how = how_a_person_approves(server_url(settings), task_id=task.id, question="mcp")
    try:
        check_approver(call.token, what, how)
        check_answerer(task.asker, call.token, consent=bool(question.get("approval", True)),
                       four_eyes=bool(getattr(settings, "four_eyes", False)), what=what, how=how)
    except ApprovalRefused as exc:
        raise TaskError(403, str(exc)) from None


def _ref(call: GatewayCall) -> TokenRef:
    """The caller's token as the hub's batches name their caller and a question's answerer."""
    return TokenRef(call.token.name, call.token.agent)


def _may_not_approve(call: GatewayCall, task: Task, settings: Any) -> bool:
    try:
        _need_approve(call, "approve", task, settings)
    except TaskError:
        return True
    return False


def _who(call: GatewayCall) -> str:
    """As the gateway's device calls name their caller in the audit: the MCP client and the token."""
    return f"mcp:{call.client} by api:{call.token.name}"


def _refused(tool: str, exc: ValidationError, hint: str | None = None) -> GatewayReply:
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}" for e in exc.errors())
    return GatewayReply(f"{tool}: {problems}" + (f" ({hint})" if hint else ""), is_error=True)
