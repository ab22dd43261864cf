"""`subscriptions/listen` at `/mcp`: list changes per token and device, and the tasks extension's task status.

The wire, as the specifications give it (not guessed):

- MCP 2026-07-28 (SEP-2575; mcp 2.3's `mcp_types.SubscriptionsListenRequestParams`, `SubscriptionFilter`,
  `mcp/server/subscriptions.py`): the request's `params.notifications` opts in to `toolsListChanged`,
  `promptsListChanged`, `resourcesListChanged` (and `resourceSubscriptions`, which this gateway does not
  honour: it has no per-resource updates). The first frame on the request's stream is
  `notifications/subscriptions/acknowledged` with the subset the server honours; every frame carries
  `_meta["io.modelcontextprotocol/subscriptionId"]`, the listen request's JSON-RPC id. A kind the client did
  not ask for is never sent.
- The tasks extension (`io.modelcontextprotocol/tasks`, ext-tasks `specification/2026-07-28/tasks.md`,
  "Task Status Notifications"): `notifications.taskIds` asks for `notifications/tasks` about those tasks, whose
  params are the task exactly as `tasks/get` would return it then; the acknowledgement lists the task ids
  the server agreed to; a client asking for task ids without declaring the extension gets -32021
  (MissingRequiredClientCapability).

What tether adds: a list change is about one device, and a stream hears of it only when the device is one
its token (and `?devices=` filter) admits, so a scoped token learns nothing of other devices. Task ids are
honoured only for tasks of the listening token (another token's id is left out of the acknowledgement as an
unknown one is: the answer does not say it exists); each honoured task's current state is sent right after
the acknowledgement, so a task that changed just before the stream opened is not missed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp.shared.subscriptions import (
    SUBSCRIPTION_ID_META_KEY,
    PromptsListChanged,
    ResourcesListChanged,
    ToolsListChanged,
    event_to_notification,
)
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    SubscriptionFilter,
    SubscriptionsAcknowledgedNotification,
    SubscriptionsAcknowledgedNotificationParams,
    SubscriptionsListenRequestParams,
    SubscriptionsListenResult,
)
from pydantic import BaseModel

from tether.server.mcp.listing import DeviceFilter

logger = logging.getLogger(__name__)

TASK_NOTIFICATION = "notifications/tasks"  # ext-tasks 2026-07-28: TaskStatusNotification's method
MAX_TASK_IDS = 100  # task ids one stream may follow
_LIST_EVENTS: dict[str, ToolsListChanged | ResourcesListChanged | PromptsListChanged] = {
    "tools": ToolsListChanged(), "resources": ResourcesListChanged(), "prompts": PromptsListChanged()}

Who = Callable[[ServerRequestContext[Any]], "tuple[DeviceFilter, str] | None"]
Owns = Callable[[str, str], bool]  # (token id, task id): whether that token's task exists here
Current = Callable[[ServerRequestContext[Any], str], Awaitable["dict[str, Any] | None"]]  # the task as tasks/get


@dataclass(frozen=True)
class ListsChanged:
    """Lists of one device changed: `kinds` among "tools", "resources", "prompts"."""

    kinds: frozenset[str]
    device: str


@dataclass(frozen=True)
class TaskChanged:
    """A task of token `owner` changed; `task` is what `tasks/get` returns for it now."""

    task_id: str
    owner: str
    task: dict[str, Any]


Event = ListsChanged | TaskChanged


class _Notification(BaseModel):
    """A notification the SDK's typed union does not know (the tasks extension's): method and params as sent."""

    method: str
    params: dict[str, Any]


@dataclass(frozen=True)
class _Stream:
    keep: DeviceFilter
    owner: str
    kinds: frozenset[str]
    task_ids: frozenset[str]

    def wants(self, event: Event) -> bool:
        if isinstance(event, TaskChanged):
            return event.owner == self.owner and event.task_id in self.task_ids
        return bool(self.kinds & event.kinds) and self.keep.admits(event.device)


class FleetListen:
    """Serves `subscriptions/listen` (register as the server's `on_subscriptions_listen`); `publish` hands an
    event to every open stream that wants it (synchronous: called from the event loop, never blocks)."""

    def __init__(self, who: Who, owns: Owns, current: Current, requires_tasks: Callable[[Any], object], *,
                 max_streams: int = 1024, max_buffered: int = 1024) -> None:
        self.who, self.owns, self.current, self.requires_tasks = who, owns, current, requires_tasks
        self.max_streams, self.max_buffered = max_streams, max_buffered
        self._streams: dict[object, tuple[_Stream, MemoryObjectSendStream[Event]]] = {}

    def publish(self, event: Event) -> None:
        for key, (stream, send) in list(self._streams.items()):
            if not stream.wants(event):
                continue
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:  # a client that stopped reading: its stream ends (it re-listens)
                logger.warning("MCP gateway: a listen stream's backlog is full; ending it")
                self._streams.pop(key, None)
                send.close()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._streams.pop(key, None)

    def close(self) -> None:
        for _, send in list(self._streams.values()):
            send.close()
        self._streams.clear()

    async def __call__(self, ctx: ServerRequestContext[Any], params: SubscriptionsListenRequestParams
                       ) -> SubscriptionsListenResult:
        subscription_id = ctx.request_id
        if subscription_id is None:
            raise MCPError(INVALID_REQUEST, "subscriptions/listen requires a request id")
        admitted = self.who(ctx)
        if admitted is None:
            raise MCPError(INTERNAL_ERROR, "subscriptions/listen without its checked token")
        if len(self._streams) >= self.max_streams:
            raise MCPError(INTERNAL_ERROR, "subscription limit reached")
        keep, owner = admitted
        asked = params.notifications
        wanted_ids = (asked.model_extra or {}).get("taskIds")
        if wanted_ids is not None:
            self.requires_tasks(ctx)  # -32021 unless the request declares the tasks extension
            if not isinstance(wanted_ids, list) or not all(isinstance(t, str) for t in wanted_ids):
                raise MCPError(-32602, "notifications.taskIds: a list of task ids")
        task_ids = [t for t in list(dict.fromkeys(wanted_ids or []))[:MAX_TASK_IDS] if self.owns(owner, t)]
        kinds = frozenset(k for k, on in (("tools", asked.tools_list_changed), ("resources",
                          asked.resources_list_changed), ("prompts", asked.prompts_list_changed)) if on)
        stream = _Stream(keep, owner, kinds, frozenset(task_ids))
        meta: dict[str, Any] = {SUBSCRIPTION_ID_META_KEY: subscription_id}
        honored = SubscriptionFilter(tools_list_changed="tools" in kinds or None,
                                     resources_list_changed="resources" in kinds or None,
                                     prompts_list_changed="prompts" in kinds or None,
                                     **({"taskIds": task_ids} if wanted_ids is not None else {}))
        send, receive = anyio.create_memory_object_stream[Event](self.max_buffered)
        key = object()
        self._streams[key] = (stream, send)  # before the acknowledgement: nothing published meanwhile is lost
        try:
            await ctx.session.send_notification(SubscriptionsAcknowledgedNotification(
                params=SubscriptionsAcknowledgedNotificationParams(notifications=honored, _meta=meta)),
                related_request_id=subscription_id)
            for task_id in task_ids:  # where each task stands now
                task = await self.current(ctx, task_id)
                if task is not None:
                    await self._send_task(ctx, task, meta)
            async for event in receive:
                if isinstance(event, TaskChanged):
                    await self._send_task(ctx, event.task, meta)
                    continue
                for kind in sorted(stream.kinds & event.kinds):
                    await ctx.session.send_notification(event_to_notification(_LIST_EVENTS[kind], meta),
                                                        related_request_id=subscription_id)
        finally:
            self._streams.pop(key, None)
            send.close()
            receive.close()
        return SubscriptionsListenResult(_meta=meta)

    @staticmethod
    async def _send_task(ctx: ServerRequestContext[Any], task: dict[str, Any], meta: dict[str, Any]) -> None:
        notification = _Notification(method=TASK_NOTIFICATION, params={**task, "_meta": meta})
        await ctx.session.send_notification(notification, related_request_id=ctx.request_id)  # type: ignore[arg-type]
