"""Contributed tools (the agent's `run_task`) as tasks of the MCP tasks extension at `/mcp`.

The wire is the extension's (`io.modelcontextprotocol/tasks`, ext-tasks `specification/2026-07-28/tasks.md`),
as handlers/tasks.py speaks it for device calls: a `tools/call` of a client declaring the extension is
answered with a `CreateTaskResult` (`resultType: "task"` and the `Task`: `taskId`, `status`, `createdAt`,
`lastUpdatedAt`, `ttlMs`, `pollIntervalMs`, `statusMessage`) at once; `tasks/get` returns the `DetailedTask`
(`inputRequests` while `input_required`, `result` once `completed`, `error` once `failed`); `tasks/update`
answers `inputRequests` by key; `tasks/cancel` is acknowledged with an empty result; `notifications/tasks`
(handlers/listen.py) carries the same `DetailedTask` whenever it changes.

Here the task is the tool's own (`ToolTasks`, contributed.py): for `run_task` the tether task itself, its
id the MCP `taskId`, so a client may also follow it with `get_task` or `tether log`. The gateway keeps only
which token created it, in this process's memory, for `TTL_MS`: every request about it must come with that
token (another token's request is "not found", as an unknown id is), from any connection (a stateless
2026-07-28 client sends each poll on a new one). Since the extension has no `tasks/result`, a tool-level
failure (the tether task failed) is a `completed` task whose result has `isError: true`, as the extension
requires; `failed` is kept for an error of the gateway itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import mcp_types as types
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from tether.server.mcp.contributed import GatewayCall, GatewayReply, GatewayTool, TaskRefused, TaskView
from tether.server.mcp.handlers.listen import TaskChanged

logger = logging.getLogger(__name__)

TTL_MS = 24 * 3_600_000  # how long the gateway keeps a task's owner (the tether task itself is kept for good)
POLL_INTERVAL_MS = 1000
MAX_TASKS = 4096
TERMINAL = ("completed", "failed", "cancelled")


def iso(at: float) -> str:
    """An epoch time as the extension's ISO 8601 timestamps."""
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class _Entry:
    task_id: str
    owner: str  # the token's id
    tool: GatewayTool
    call: GatewayCall  # the creating request's: what a notification shows is what that caller may see
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    born: float = field(default_factory=time.monotonic)
    last: tuple[Any, ...] | None = None  # what the last notification said (status, message, questions)
    seen: tuple[Any, ...] | None = None  # what the task last showed: a change moves `updated`
    follower: asyncio.Task[None] | None = None
    connection: Any = None  # a 2025-11-25 session's (the SDK's Connection): told of changes on its stream
    waiters: list[asyncio.Event] = field(default_factory=list)  # set at the next change (`moved`)


def reply_result(reply: GatewayReply) -> dict[str, Any]:
    """A contributed tool's reply as the `CallToolResult` the synchronous call returns."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=reply.text)],
                                structured_content=reply.structured, is_error=reply.is_error
                                ).model_dump(mode="json", by_alias=True, exclude_none=True)


class ToolTaskRegistry:
    """The contributed tools' tasks of this gateway, by task id; `publish(change, connection)` hears each change
    (`connection`: the creating 2025-11-25 session's, else None)."""

    def __init__(self, publish: Callable[[TaskChanged, Any], None]) -> None:
        self.publish = publish
        self._entries: dict[str, _Entry] = {}

    def owns(self, owner: str, task_id: str) -> bool:
        entry = self._entries.get(task_id)
        return entry is not None and entry.owner == owner

    def ids_of(self, owner: str) -> list[str]:
        """The ids of `owner`'s tasks kept here, oldest first."""
        return [task_id for task_id, entry in self._entries.items() if entry.owner == owner]

    def moved(self, owner: str, task_id: str) -> asyncio.Event:
        """An event set at the task's next change (or when it ends)."""
        event = asyncio.Event()
        self._find(owner, task_id).waiters.append(event)
        return event

    async def start(self, owner: str, tool: GatewayTool, arguments: dict[str, Any], call: GatewayCall,
                    connection: Any = None) -> dict[str, Any] | GatewayReply:
        """The `CreateTaskResult` of a new task, or the tool's reply when it started nothing."""
        assert tool.tasks is not None
        started = await tool.tasks.start(arguments, call)
        if isinstance(started, GatewayReply):
            return started
        entry = _Entry(started, owner, tool, call, connection=connection)
        self._keep(entry)
        shown = await self._shown(entry, call)
        entry.last = _said(shown)
        entry.follower = asyncio.ensure_future(self._follow(entry))
        return {"resultType": "task", **shown}

    async def get(self, owner: str, task_id: str, call: GatewayCall) -> dict[str, Any]:
        """`tasks/get`'s `DetailedTask`; -32602 for an unknown task or another token's."""
        return await self._shown(self._find(owner, task_id), call)

    async def update(self, owner: str, task_id: str, responses: dict[str, Any], call: GatewayCall) -> None:
        entry = self._find(owner, task_id)
        assert entry.tool.tasks is not None
        for key, response in responses.items():
            answer = response if isinstance(response, dict) else {"action": "cancel"}
            try:
                await entry.tool.tasks.answer(task_id, str(key), answer, call)
            except TaskRefused as exc:
                raise MCPError(INVALID_PARAMS, str(exc)) from None

    async def cancel(self, owner: str, task_id: str, call: GatewayCall) -> None:
        entry = self._find(owner, task_id)
        assert entry.tool.tasks is not None
        try:
            await entry.tool.tasks.cancel(task_id, call)
        except TaskRefused as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None

    async def current(self, owner: str, task_id: str, call: GatewayCall) -> dict[str, Any] | None:
        """The task as `tasks/get` shows it, or None when it is not this owner's."""
        entry = self._entries.get(task_id)
        return None if entry is None or entry.owner != owner else await self._shown(entry, call)

    def close(self) -> None:
        for entry in self._entries.values():
            if entry.follower is not None:
                entry.follower.cancel()
        self._entries.clear()

    # -- inside -------------------------------------------------------------------------------------------

    def _find(self, owner: str, task_id: str) -> _Entry:
        entry = self._entries.get(task_id)
        if entry is None or entry.owner != owner:  # another token's task is not found either
            raise MCPError(INVALID_PARAMS, "task not found (unknown, expired, or another token's)")
        return entry

    def _keep(self, entry: _Entry) -> None:
        now = time.monotonic()
        for task_id, old in list(self._entries.items()):
            if (now - old.born) * 1000 > TTL_MS:
                self._drop(task_id)
        while len(self._entries) >= MAX_TASKS:
            self._drop(next(iter(self._entries)))  # the oldest first
        self._entries[entry.task_id] = entry

    def _drop(self, task_id: str) -> None:
        entry = self._entries.pop(task_id, None)
        if entry is not None and entry.follower is not None:
            entry.follower.cancel()  # stops following; the tether task itself goes on

    async def _shown(self, entry: _Entry, call: GatewayCall) -> dict[str, Any]:
        assert entry.tool.tasks is not None
        try:
            view = await entry.tool.tasks.view(entry.task_id, call)
        except TaskRefused as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        except Exception:
            logger.exception("MCP gateway: task %s of %s could not be read", entry.task_id[:12], entry.tool.name)
            view = TaskView("failed", "the task could not be read inside the server; the server log has the details")
        return self._detailed(entry, view)

    def _detailed(self, entry: _Entry, view: TaskView) -> dict[str, Any]:
        said = (view.status, view.message, tuple(sorted(view.questions)))
        if said != entry.seen:
            if entry.seen is not None:
                entry.updated = time.time()
            entry.seen = said
        shown: dict[str, Any] = {"taskId": entry.task_id, "status": view.status, "createdAt": iso(entry.created),
                                 "lastUpdatedAt": iso(entry.updated), "ttlMs": TTL_MS,
                                 "pollIntervalMs": POLL_INTERVAL_MS}
        if view.message:
            shown["statusMessage"] = view.message
        if view.status == "input_required":
            shown["inputRequests"] = {key: {"method": "elicitation/create", "params": {
                "mode": "form", "message": message, "requestedSchema": schema}}
                for key, (message, schema) in view.questions.items()}
        elif view.status == "completed" and view.reply is not None:
            shown["result"] = reply_result(view.reply)
        elif view.status == "failed":
            shown["error"] = {"code": -32603, "message": view.message or "the task failed inside the server"}
        return shown

    async def _follow(self, entry: _Entry) -> None:
        """Publish the task whenever what it shows changes, until it has ended."""
        assert entry.tool.tasks is not None
        try:
            async for _ in entry.tool.tasks.changes(entry.task_id):
                await self._tell(entry)
            await self._tell(entry)  # its end
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("MCP gateway: task %s is no longer followed", entry.task_id[:12])

    async def _tell(self, entry: _Entry) -> None:
        shown = await self._shown(entry, entry.call)
        said = _said(shown)
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            waiter.set()
        if said != entry.last:
            entry.last = said
            self.publish(TaskChanged(entry.task_id, entry.owner, shown), entry.connection)


def _said(shown: dict[str, Any]) -> tuple[Any, ...]:
    return shown["status"], shown.get("statusMessage"), tuple(sorted(shown.get("inputRequests") or ()))
