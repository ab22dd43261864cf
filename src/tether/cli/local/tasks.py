"""Tasks on this machine end in a clear state whatever happens.

A local task lives in the process that runs it: when that process is killed the task would stay
`running` in tasks.db forever. Each run holds a lock on its task (see `RunLocks`); any command that
opens the store first marks the unfinished tasks whose lock is free as `interrupted`, which
`tether cancel` can then settle. Questions are asked here with the one answer parser servers use.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tether.agent.run.replies import AnswerError, Unanswered, parse_answer


def state_path(state_dir: Path | None) -> Path:
    from tether.tools.context import default_state_dir

    return Path(state_dir or default_state_dir())


def run_locks(state_dir: Path | None) -> Any:
    from tether.agent.tasks.store import RunLocks

    return RunLocks(state_path(state_dir) / "running")


def open_local_store(state_dir: Path | None) -> Any:
    """This machine's task store, with the tasks of tether processes that died marked `interrupted`."""
    from tether.agent.tasks.store import TaskStore

    store = TaskStore(state_path(state_dir) / "tasks.db")
    store.mark_interrupted(run_locks(state_dir))
    return store


def terminal_ask(out: Console, answers: list[str]) -> Callable[[Any], Awaitable[str]]:
    """The local task's `ask`: from --answer first, then the terminal until an answer can be taken;
    `Unanswered` when neither is left (the question itself was shown with its event)."""

    async def ask(question: Any) -> str:
        options, kind = list(question.options), str(getattr(question, "kind", "question"))
        while answers:
            reply = answers.pop(0)
            try:
                parsed = parse_answer(reply, options, kind)
            except AnswerError as exc:
                out.print(f"--answer {reply}: {exc}", style="red", markup=False)
                continue
            out.print(f"  → {reply} (from --answer)", markup=False)
            return parsed
        if not sys.stdin.isatty():
            raise Unanswered(question.question)
        while True:
            try:
                reply = await asyncio.to_thread(input, "answer (number or text): ")
            except EOFError:
                raise Unanswered(question.question) from None
            try:
                return parse_answer(reply, options, kind)
            except AnswerError as exc:
                out.print(str(exc), style="yellow", markup=False)

    return ask


def cancel_local(task_id: str, state_dir: Path | None) -> tuple[str, str]:
    """Cancel a local task that no live process runs (an interrupted one, or one left waiting):
    (its id, its state after). `LookupError`/`ValueError` with what to do otherwise."""
    from tether.agent.run.task import TaskState

    store = open_local_store(state_dir)
    try:
        task = store.find(task_id)
        if task.state.terminal:
            raise ValueError(f"task {task.id} has already ended ({task.state.value})")
        with run_locks(state_dir).held(task.id, wait=False) as mine:
            if not mine:
                raise ValueError(f"task {task.id} is running in another tether process; press Ctrl-C there")
            task.error = "cancelled by the user (tether cancel)"
            task.transition(TaskState.CANCELLED, error=task.error)
            store.save(task)
        return task.id, task.state.value
    finally:
        store.close()
