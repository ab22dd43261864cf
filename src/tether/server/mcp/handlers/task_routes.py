"""The `tasks/*` methods at `/mcp`, for both protocol generations, over the gateway's two kinds of task.

Kinds: a device call that asked or ran long (handlers/tasks.py, 2026-07-28 only) and a contributed tool's
task (`run_task`, handlers/tool_tasks.py). Every request reaches only its own token's tasks; another
token's id is "not found" (-32602), as an unknown one is.

MCP 2026-07-28, the tasks extension (ext-tasks `specification/2026-07-28/tasks.md`): `tasks/get` (the
`DetailedTask`), `tasks/update` (`inputResponses` by key), `tasks/cancel` (an empty acknowledgement), each
refused with -32021 to a request not declaring `io.modelcontextprotocol/tasks`; there is no `tasks/result`
nor `tasks/list`; status changes go out as `notifications/tasks` on `subscriptions/listen` (handlers/listen.py).

MCP 2025-11-25, tasks in the core protocol (the shapes of mcp 2.3's `mcp_types/_v2025_11_25`: `Task` with
`taskId`, `status`, `statusMessage`, `createdAt`, `lastUpdatedAt`, `ttl`, `pollInterval`; `CreateTaskResult`
`{"task": Task}`; `GetTaskResult` and `CancelTaskResult` the `Task` itself; `GetTaskPayloadRequest`
`tasks/result`, whose result is the original request's result with `_meta["io.modelcontextprotocol/related-task"]`;
`ListTasksResult` `{"tasks": [...]}`; `TaskStatusNotification` `notifications/tasks/status` whose params are the
`Task`): a `tools/call` carrying `params.task` for a tool listed with `execution.taskSupport` is answered with
the task at once (`legacy_call`, a server middleware: the SDK's result check knows only `CallToolResult` for
tools/call); `tasks/result` waits for the end, asking the task's questions through the client's elicitation
on that request as the synchronous call would; status changes go to the creating session's stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, RequestParams
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from tether.server.mcp.contributed import GatewayCall, GatewayTool
from tether.server.mcp.handlers.context import admitted_of, caller_of, declared_elicitation, elicit_of, task_owner
from tether.server.mcp.handlers.listen import Event, TaskChanged
from tether.server.mcp.handlers.tasks import CallTasks, TaskIdParams, TaskUpdateParams
from tether.server.mcp.handlers.tool_tasks import TERMINAL, ToolTaskRegistry

logger = logging.getLogger(__name__)

RELATED_TASK = "io.modelcontextprotocol/related-task"
STATUS_NOTIFICATION = "notifications/tasks/status"  # 2025-11-25
RECHECK = 5.0  # seconds tasks/result waits for a change before looking at the task again
MAX_LISTED = 1000

Asker = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


def legacy_task(shown: dict[str, Any]) -> dict[str, Any]:
    """A 2026-07-28 `DetailedTask` as the 2025-11-25 `Task` (no inlined result, questions or error)."""
    task = {"taskId": shown["taskId"], "status": shown["status"], "createdAt": shown["createdAt"],
            "lastUpdatedAt": shown["lastUpdatedAt"], "ttl": shown.get("ttlMs"),
            "pollInterval": shown.get("pollIntervalMs")}
    if shown.get("statusMessage"):
        task["statusMessage"] = shown["statusMessage"]
    return task


class _ListParams(RequestParams):
    cursor: str | None = None


class TaskRoutes:
    """The gateway's tasks and the methods that reach them; `publish` hears each change of either kind."""

    def __init__(self, publish: Callable[[Event], None], asker: Asker) -> None:
        self.publish, self.asker = publish, asker
        self.tools = ToolTaskRegistry(self._changed)
        self.calls = CallTasks(lambda t: publish(TaskChanged(t.task_id, t.owner, t.view())))
        self._sends: set[asyncio.Future[None]] = set()

    def register(self, server: Any) -> None:
        """Add the methods to the SDK's low-level `server`."""
        server.add_request_handler("tasks/get", TaskIdParams, self.get)
        server.add_request_handler("tasks/update", TaskUpdateParams, self.update)
        server.add_request_handler("tasks/cancel", TaskIdParams, self.cancel)
        server.add_request_handler("tasks/result", TaskIdParams, self.result)
        server.add_request_handler("tasks/list", _ListParams, self.list)

    def close(self) -> None:
        self.calls.close()
        self.tools.close()

    def owns(self, owner: str, task_id: str) -> bool:
        return self.tools.owns(owner, task_id) or self.calls.owns(owner, task_id)

    async def current(self, ctx: ServerRequestContext[Any], task_id: str) -> dict[str, Any] | None:
        """The task as `tasks/get` shows it to this request's token now, or None when it is not its task."""
        owner = admitted_of(ctx).token.id
        if self.tools.owns(owner, task_id):
            return await self.tools.current(owner, task_id, self.call_of(ctx))
        return self.calls.get(owner, task_id) if self.calls.owns(owner, task_id) else None

    def call_of(self, ctx: ServerRequestContext[Any], elicit: Asker | None = None) -> GatewayCall:
        """The caller of a task request as a contributed tool's tasks see it: `elicit` set when the client
        declared elicitation (by default a marker: the questions then ride `inputRequests`)."""
        admitted = admitted_of(ctx)
        return GatewayCall(token=admitted.token, client=caller_of(ctx, admitted).client.split(" ", 1)[0],
                           progress=_no_progress,
                           elicit=(elicit or self.asker) if declared_elicitation(ctx) else None)

    async def start(self, ctx: ServerRequestContext[Any], tool: GatewayTool, arguments: dict[str, Any]) -> Any:
        """A contributed tool's task, started for a client of either era: the 2026 `CreateTaskResult`, the
        2025 one (`{"task": Task}`), or the tool's `GatewayReply` when it started nothing."""
        modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        connection = None if modern else getattr(ctx.session, "_connection", None)  # (the SDK's Connection)
        started = await self.tools.start(admitted_of(ctx).token.id, tool, arguments, self.call_of(ctx),
                                         connection=connection)
        if isinstance(started, dict) and not modern:
            return {"task": legacy_task(started)}
        return started

    # -- the methods ----------------------------------------------------------------------------------

    async def get(self, ctx: ServerRequestContext[Any], params: TaskIdParams) -> dict[str, Any]:
        owner = self._owner(ctx)
        if self._legacy(ctx):
            return legacy_task(await self.tools.get(owner, params.task_id, self.call_of(ctx)))
        if self.tools.owns(owner, params.task_id):
            return {"resultType": "complete", **await self.tools.get(owner, params.task_id, self.call_of(ctx))}
        return {"resultType": "complete", **self.calls.get(owner, params.task_id)}

    async def update(self, ctx: ServerRequestContext[Any], params: TaskUpdateParams) -> dict[str, Any]:
        owner = task_owner(ctx)
        if self.tools.owns(owner, params.task_id):
            await self.tools.update(owner, params.task_id, params.input_responses, self.call_of(ctx))
        else:
            self.calls.update(owner, params.task_id, params.input_responses)
        return {"resultType": "complete"}

    async def cancel(self, ctx: ServerRequestContext[Any], params: TaskIdParams) -> dict[str, Any]:
        owner = self._owner(ctx)
        if self._legacy(ctx):
            await self.tools.cancel(owner, params.task_id, self.call_of(ctx))
            return legacy_task(await self.tools.get(owner, params.task_id, self.call_of(ctx)))
        if self.tools.owns(owner, params.task_id):
            await self.tools.cancel(owner, params.task_id, self.call_of(ctx))
        else:
            self.calls.cancel(owner, params.task_id)
        return {"resultType": "complete"}

    async def result(self, ctx: ServerRequestContext[Any], params: TaskIdParams) -> dict[str, Any]:
        """2025-11-25 `tasks/result`: the tool's result once the task has ended (asking its questions through
        the client meanwhile, when it declared elicitation)."""
        if not self._legacy(ctx):
            raise MCPError(-32601, "tasks/result is not a method of MCP 2026-07-28's tasks extension: poll tasks/get")
        owner = self._owner(ctx)
        ask = elicit_of(ctx)
        call = self.call_of(ctx, ask)
        asked: set[str] = set()
        while True:
            moved = self.tools.moved(owner, params.task_id)
            shown = await self.tools.get(owner, params.task_id, call)
            if shown["status"] in TERMINAL:
                break
            fresh = {k: q for k, q in (shown.get("inputRequests") or {}).items() if k not in asked}
            if ask is not None and fresh:
                for key, question in fresh.items():
                    asked.add(key)
                    answer = await _asked(ask, question["params"])
                    await self.tools.update(owner, params.task_id, {key: answer}, call)
                continue
            try:
                await asyncio.wait_for(moved.wait(), RECHECK)
            except TimeoutError:
                pass
        related = {RELATED_TASK: {"taskId": params.task_id}}
        if shown["status"] == "completed":
            return {**{k: v for k, v in shown["result"].items() if k != "resultType"}, "_meta": related}
        if shown["status"] == "failed":
            raise MCPError(shown["error"]["code"], shown["error"]["message"])
        raise MCPError(INVALID_PARAMS, f"task {params.task_id} was cancelled: it has no result")

    async def list(self, ctx: ServerRequestContext[Any], params: _ListParams) -> dict[str, Any]:
        """2025-11-25 `tasks/list`: this token's tasks (no more than `MAX_LISTED`, one page)."""
        if not self._legacy(ctx):
            raise MCPError(-32601, "tasks/list is not a method of MCP 2026-07-28's tasks extension")
        owner = self._owner(ctx)
        listed = [legacy_task(await self.tools.get(owner, task_id, self.call_of(ctx)))
                  for task_id in self.tools.ids_of(owner)[:MAX_LISTED]]
        return {"tasks": listed}

    # -- inside ---------------------------------------------------------------------------------------

    @staticmethod
    def _legacy(ctx: ServerRequestContext[Any]) -> bool:
        return ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS

    def _owner(self, ctx: ServerRequestContext[Any]) -> str:
        # 2026-07-28: the request must declare the extension (-32021); 2025-11-25: tasks are core
        return admitted_of(ctx).token.id if self._legacy(ctx) else task_owner(ctx)

    def _changed(self, event: TaskChanged, connection: Any) -> None:
        self.publish(event)
        if connection is not None:  # a 2025-11-25 session's task: told on its stream (best effort)
            send = asyncio.ensure_future(connection.notify(STATUS_NOTIFICATION, legacy_task(event.task)))
            self._sends.add(send)
            send.add_done_callback(self._sends.discard)


async def _asked(ask: Asker, question: dict[str, Any]) -> dict[str, Any]:
    """A question of `inputRequests` asked through the client; `cancel` when it could not be."""
    try:
        return await ask(str(question.get("message", "")), question.get("requestedSchema") or {})
    except Exception as exc:
        logger.info("MCP gateway: a task's question could not be asked through the client: %s", exc)
        return {"action": "cancel"}


async def _no_progress(done: float, total: float | None, message: str | None) -> None:
    return None
