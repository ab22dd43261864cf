"""Who may write into which undo session.

A session id names a device's undo journal (and the held changes a command left for approval): the
commands sent under it journal their file changes there, and undoing the session — an approved
action — puts all of them back. So a session belongs to whoever opened it, recorded in the server's
store (`Sessions.claim`) and never handed over:

- a task owns the session named by its id (`task:<id>`), claimed when the task is created; only the
  task's own commands write into it, and only `POST /api/v1/tasks/{id}/undo` (the `approve` scope)
  undoes it;
- an API token (by name, as the audit log names it: `api:<name>`) owns the sessions it named first
  in a REST batch's `session_id`, and its own default session `api-<name>`, which a batch without a
  `session_id` runs in (never whatever session the device ran last).

A REST batch naming a session someone else owns — a task's, another token's, another token's
default — is refused with 403 before anything is sent, and each of its commands gets an audit row
saying so; likewise an `undo_session` command aimed at a session the caller does not own.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from fastapi import HTTPException

from tether.protocol.models import Command
from tether.server.store import Store
from tether.server.store.tokens import TokenInfo

DEFAULT_PREFIX = "api-"  # a token's default session; nobody else may name one
_JOURNAL_NAME = re.compile(r"[A-Za-z0-9_.@+=-]+")  # what a device's journal takes after the prefix (tools/journal/)


def token_owner(who: TokenInfo) -> str:
    return f"api:{who.name}"


def task_owner(task_id: str) -> str:
    return f"task:{task_id}"


def default_session(who: TokenInfo) -> str:
    """The session a token's batches without a `session_id` run in: `api-<name>`, or `api-<digest of the name>`
    when that is no valid journal name (too long, or an OIDC identity's `oidc:subject`)."""
    name = DEFAULT_PREFIX + who.name
    if len(name) <= 128 and ".." not in name and _JOURNAL_NAME.fullmatch(who.name):
        return name
    return DEFAULT_PREFIX + hashlib.sha256(who.name.encode()).hexdigest()[:48]


def claim_task_sessions(store: Store, task_ids: Iterable[str]) -> None:
    """Tasks own their sessions (the task id): claimed at creation, and for older tasks at start-up."""
    store.sessions.claim_many((task_id, task_owner(task_id)) for task_id in task_ids)


async def why_not_owned(store: Store, session_id: str, who: TokenInfo) -> str | None:
    """None when `who` may write into `session_id` (it owns it, or it was free and now does), else why not. A
    session's owner is answered from memory once known; a claim runs without holding up the event loop."""
    mine = token_owner(who)
    if session_id.startswith(DEFAULT_PREFIX) and session_id != default_session(who):
        return (f"session '{session_id}' is another API token's default session ('{DEFAULT_PREFIX}<name>' names "
                f"are reserved); yours is '{default_session(who)}'")
    owner = store.sessions.known(session_id)
    if owner is None:
        owner = await store.call(store.sessions.claim, session_id, mine)
    if owner == mine:
        return None
    if owner.startswith("task:"):
        return (f"session '{session_id}' belongs to task {owner[5:]}: only the task's own commands write into it, "
                f"and POST /api/v1/tasks/{owner[5:]}/undo (approve scope) undoes it")
    return f"session '{session_id}' belongs to another API token; choose a session id of your own"


async def owned_session(store: Store, device: str, session_id: str | None, commands: list[Command],
                        who: TokenInfo) -> str:
    """The session a REST batch from `who` runs in: the one it named, if it may write there, else its
    default. Raises 403 `{"error": …}` (after writing an audit row per command) when the batch names a
    session — or an `undo_session` command a session — that is not the caller's."""
    session = session_id if session_id is not None else default_session(who)
    problem = ("session ids are at most 128 characters" if len(session) > 128
               else await why_not_owned(store, session, who))
    for command in commands:
        if problem is not None:
            break
        if command.tool_name == "undo_session":
            target = (command.parameters or {}).get("session_id")
            if not isinstance(target, str):
                continue  # the device refuses it as bad arguments
            problem = await why_not_owned(store, target, who)
            if problem is not None:
                problem = f"undo_session refused: {problem}"
    if problem is None:
        return session
    error = f"refused: {problem}"
    store.audit.record_many((token_owner(who), device, c.call_id, c.tool_name, c.parameters, "failure", error, None,
                      c.approved_by) for c in commands)
    raise HTTPException(403, error)
