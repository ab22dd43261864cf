"""Steering a task: answers, approvals, an MCP server's questions, cancelling; here or on the node running it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tether.agent.run.decisions import OPTION_APPROVE, OPTION_DENY
from tether.agent.run.task import Question, Task, TaskState
from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.service.running import Running
from tether.server.aip.batches.ledger import TokenRef
from tether.server.trust.approvals import ApprovalRefused

NO_QUESTION = "-"  # what an answer is pinned to when no question was open where it was judged
# How long an answer's (or a cancel's) reply waits for the row holding it to be written, and an answer's for its
# runner to take it (a locked or stalled database): past it the reply is 503, and the write is retried.
REPLY_SAVE_WAIT_S = 10.0


def judged_question(pending: Question | None, question_id: str | None) -> str:
    """The question an answer was judged against (whether it approves, and whether its token may), to send with
    it as `question_id`: the answer is then applied to that very question or refused (409), never to another one
    that opened since, here or on the node running the task (whose view may be ahead of the stored row the
    route read). `pending` is the open question as the route saw it; `question_id` the one the caller named:
    TaskError 409 when it is not that one (the caller answers a question this view cannot judge)."""
    seen = pending.id if pending is not None else NO_QUESTION
    if question_id is not None and question_id != seen:
        raise TaskError(409, f"question {question_id[:64]} is not the open one here ("
                             + (f"that is {seen}" if pending is not None else "none is open as this server sees the "
                                "task") + "): look at the task again, nothing was answered")
    return seen


class Answering(Running):
    """The task service's steering: what people (and the cluster's other nodes for them) send a task."""

    async def steer(self, task_id: str, action: str, by: str, **args: Any) -> Task | dict[str, Any]:
        """Answer, approve or cancel a task: here, or in a cluster on the node that runs it (its summary
        then). The caller checked the token's scopes; the node that runs the task checks the rest."""
        try:
            return await self.steer_here(task_id, action, by, args)
        except TaskError as exc:
            if exc.holder is None or self._peers is None:
                raise
            return await self._peers.steer(exc.holder, task_id, action, by, args)

    async def steer_here(self, task_id: str, action: str, by: str, args: dict[str, Any]) -> Task:
        """Answer, approve or cancel the task on this node; the task and its lease are read off the event loop
        first (`steerable`), so the synchronous steps below find them in memory."""
        if action not in ("answer", "approve", "cancel"):
            raise TaskError(400, f"unknown action {action!r}")
        checked = await self.steerable(task_id)
        self._checked[task_id] = self._checked[checked.id] = checked  # as given, and whole (approve answers)
        try:
            if action == "cancel":
                return await self.cancel(task_id)  # its `_steerable` runs before its first await
            if action == "answer":
                task = self.answer(task_id, str(args.get("answer", "")), args.get("question_id"), by,
                                   digest=args.get("digest"))
            else:
                task = self.approve(task_id, bool(args.get("approved")), by, digest=args.get("digest"),
                                    question_id=args.get("question_id"))
        finally:
            self._checked.pop(task_id, None)
            self._checked.pop(checked.id, None)
        await self._answer_saved(task)
        return task

    async def _answer_saved(self, task: Task) -> None:
        """Return once the answer just given to `task` is taken by its runner and saved: what a restart finds,
        so a person told it is taken is never asked again. `TaskError` 503 when the store cannot write it (the
        answer is taken here and its save retried; the reply says so, and that a restart first asks again), 409
        (503 while the server closes) when the runner stopped before it took the answer."""
        taking = self._taking.get(task.id)
        if taking is None:  # taken already (a runner waiting for it) and its event seen
            return
        problem: str | None = None
        try:
            async with asyncio.timeout(REPLY_SAVE_WAIT_S):
                seq = await asyncio.shield(taking)
                if seq is None:
                    raise TaskError(503 if self._closing else 409, f"task {task.id} stopped before it took the "
                                    f"answer (it is {task.state.value}); nothing was answered")
                problem = await self._saver.flushed()
                for _ in range(8):  # the answer came after the row being written was serialised (PostgreSQL):
                    # that write did not hold it, the next one (already asked for) does: wait for that one too
                    if problem is not None or not any(e.seq <= seq for e in self._unsent.get(task.id, ())):
                        break
                    problem = await self._saver.flushed()
        except TimeoutError:
            raise TaskError(503, f"your answer to task {task.id} is taken here but was not saved within "
                                 f"{REPLY_SAVE_WAIT_S:g}s (the database is slow or locked): it is retried, and its "
                                 "followers are told once it is saved; if this server stops before that, the "
                                 "question is asked again") from None
        if any(e.seq <= seq for e in self._unsent.get(task.id, ())):
            raise TaskError(503, f"your answer to task {task.id} is taken here but could not be saved yet "
                                 f"({problem or 'the write is under way'}): it is retried, and its followers are "
                                 "told once it is saved; if this server stops before that, the question is asked "
                                 "again")

    def answer(self, task_id: str, answer: str, question_id: str | None = None, by: str | None = None, *,
               digest: str | None = None) -> Task:
        """Answer the task's open question; the same task goes on from where it stopped. `by` is who
        answered (an approved command carries it as `approved_by`, so the audit log names them).
        `digest`, when given, is the question's `digest` as the answerer was shown it: refused (409) when
        the open question shows something else now."""
        task = self._steerable(task_id)
        pending = task.pending_question
        if task.state is not TaskState.WAITING_FOR_USER or pending is None:
            raise TaskError(409, f"task {task.id} has no open question (it is {task.state.value})")
        if question_id == NO_QUESTION:
            raise TaskError(409, f"no question was open when this answer was checked; question {pending.id} is "
                                 "open now: look at it, nothing was answered")
        if question_id is not None and question_id != pending.id:
            raise TaskError(409, f"question {question_id} is not the open one (that is {pending.id})")
        if digest is not None and digest != pending.digest:
            raise TaskError(409, f"what you were shown (digest {digest[:24]}) is not what waits now (question "
                                 f"{pending.id}, digest {(pending.digest or 'none')[:24]}): look at it again, nothing "
                                 "was approved")
        if not answer.strip():
            raise TaskError(422, f"the answer is empty; the options are: {', '.join(pending.options)}")
        waiting = self._waiting.get(task.id)
        if (waiting is None or waiting.done()) and task.id in self._runners:
            raise TaskError(409, f"task {task.id} is not waiting for an answer right now")
        pending.answered_by = by
        # resolved by its runner's `user_answer` event (`_on_event`), or when the runner stops first
        self._taking[task.id] = asyncio.get_running_loop().create_future()
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)
        else:
            self._answers[task.id] = answer
            self._start(task)
        return task

    def mcp_question(self, task_id: str) -> dict[str, Any] | None:
        """The question an external MCP server asks during the task's running step, if one is open (the task's
        id or a unique prefix of the ids with one open). From memory: only a task running here has one, so
        nothing is read from the store."""
        found = self._mcp_open(task_id)
        return found[1] if found is not None else None

    def _mcp_open(self, task_id: str) -> tuple[str, dict[str, Any]] | None:
        """(the task's id, its open MCP question) for an id or a unique prefix, from memory."""
        question = self._mcp_questions.get(task_id)
        if question is not None:
            return task_id, question
        found = [(tid, q) for tid, q in self._mcp_questions.items() if tid.startswith(task_id)] if task_id else []
        return found[0] if len(found) == 1 else None

    async def answer_mcp_question(self, task_id: str, answer: str, by: str, *, answerer: TokenRef) -> bool:
        """Answer it (`tether answer` works for it as for the task's own questions): decline/cancel/no,
        else the value of its only field, or a JSON object of its fields; False when none is open.

        `answerer` is the API token answering; the question is the task's asker's (`Task.asker`), so the hub
        refuses (TaskError 403, the question still waits) whoever may not answer it: an agent's token always,
        another token than the asker's for a person's task (with four-eyes on, a consent question needs
        another person than the asker), and anyone but a person for an agent's task."""
        found = self._mcp_open(task_id)  # from memory: a task with one open runs here (no store read)
        if found is None:
            return False
        task, question = self._steerable(found[0]), found[1]
        action, content = mcp_answer(question.get("schema") or {}, answer)
        try:
            sent = await self.hub.answer_question(str(question.get("device")), str(question["id"]), action, content,
                                                  by=by, answerer=answerer)
        except ApprovalRefused as exc:
            raise TaskError(exc.status, str(exc)) from None
        except LookupError as exc:
            raise TaskError(409, str(exc)) from None
        self._mcp_questions.pop(task.id, None)
        if not sent:
            raise TaskError(409, f"the MCP server's question {question['id']} is no longer waiting for an answer")
        return True

    def approve(self, task_id: str, approved: bool, by: str | None = None, *, digest: str | None = None,
                question_id: str | None = None) -> Task:
        """Approve or deny the action (or confirm or cancel the plan) the task waits on; `question_id`, when
        given, pins the question the caller judged (`judged_question`): TaskError 409 when another is open."""
        task = self._steerable(task_id)
        pending = task.pending_question
        if question_id is not None and pending is not None and question_id != pending.id:
            raise TaskError(409, f"question {pending.id} is open now, not the one this approval was checked against"
                                 f" ({'none' if question_id == NO_QUESTION else question_id}): look at it, nothing "
                                 "was approved")
        if pending is not None and pending.kind == "confirmation" and task.state is TaskState.WAITING_FOR_USER:
            return self.answer(task.id, "run" if approved else "cancel", pending.id, by,  # a plan to confirm
                               digest=digest)
        if pending is None or pending.kind != "approval" or task.state is not TaskState.WAITING_FOR_USER:
            raise TaskError(409, f"task {task.id} has no action waiting for approval (it is {task.state.value}"
                                 + (f", asking: {pending.question}" if pending else "") + ")")
        return self.answer(task.id, OPTION_APPROVE if approved else OPTION_DENY, pending.id, by, digest=digest)

    async def cancel(self, task_id: str) -> Task:
        """Cancel the task (`TaskError` 409 when it has ended, or another server runs it), once the cancel is
        saved: `TaskError` 503 when it cannot be (the task is stopped and held here as cancelled, and the save
        is retried; a restart before it succeeds finds the task as last saved). A task not in memory is read
        off the event loop (`steerable`); one `steer_here` checked just now is not read again."""
        task = self._checked.get(task_id) or await self.steerable(task_id)
        ending = self.ending(task.id)
        if ending is not None:
            raise TaskError(503 if ending["unsaved"] else 409, f"task {task.id} has ended ({ending['state']}) "
                            + (f"but that could not be saved yet ({ending['unsaved']}); it is retried"
                               if ending["unsaved"] else "and that is being saved"))
        if task.state.terminal:
            raise TaskError(409, f"task {task.id} has already ended ({task.state.value})")
        running = self._runners.get(task.id)
        if running is not None:
            running[1].cancel()
            await asyncio.gather(running[1], return_exceptions=True)
        asking = self._asking.get(task.id)
        if asking is not None:  # its device is being asked about the step in flight: no longer needed
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
        if not task.state.terminal:  # not running (waiting after a restart): end it here
            task.error = "cancelled"
            self._on_event(task, task.transition(TaskState.CANCELLED, error="cancelled"))
            self._live.setdefault(task.id, task)  # one read from the store just now: held here until saved
            self._end(task)
        if task.id in self._held:  # its end waits for its save (`_end`): the caller is told what is saved
            problem = None
            try:
                async with asyncio.timeout(REPLY_SAVE_WAIT_S):
                    problem = await self._saver.flushed()
                    for _ in range(8):  # its end came after the row being written was serialised: the next one
                        if problem is not None or task.id not in self._held:
                            break
                        problem = await self._saver.flushed()
            except TimeoutError:
                problem = f"not written within {REPLY_SAVE_WAIT_S:g}s: the database is slow or locked"
            if task.id in self._held:
                raise TaskError(503, f"task {task.id} is stopped here but its cancel could not be saved yet "
                                     f"({problem or 'the write is under way'}); it is retried, and the task's "
                                     "followers are told once it is saved")
        return task


def mcp_answer(schema: dict[str, Any], answer: str) -> tuple[str, dict[str, Any] | None]:
    """A person's words as an MCP elicitation result: (action, content); TaskError when they do not fit."""
    text = answer.strip()
    if text.lower() in ("decline", "no", "cancel"):
        return ("cancel" if text.lower() == "cancel" else "decline"), None
    props: dict[str, Any] = schema.get("properties") or {}
    if not props:
        return "accept", {}
    if text.startswith("{"):
        try:
            content = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskError(422, f"the answer is not a JSON object: {exc.msg}") from None
        if isinstance(content, dict):
            return "accept", content
    if len(props) != 1:
        raise TaskError(422, f"the question has several fields ({', '.join(props)}): answer with a JSON object")
    [(key, prop)] = props.items()
    kind = prop.get("type")
    try:
        value: Any = {"integer": int, "number": float}.get(str(kind), str)(text)
    except ValueError:
        raise TaskError(422, f"{key}: expected {kind}") from None
    if kind == "boolean":
        value = text.lower() in ("y", "yes", "true", "1")
    return "accept", {key: value}
