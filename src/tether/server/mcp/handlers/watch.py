"""Telling the gateway's clients that their lists changed, and ending the sessions of revoked tokens.

Clients of the handshake era (protocol 2025-xx) are sent `notifications/tools/list_changed` on their session's
standalone stream when a device they list registers, leaves or reports new tools, and
`notifications/resources/list_changed` and `notifications/prompts/list_changed` when the device's external MCP
servers (where its resources and prompts come from, handlers/resources.py) came, went or changed with it;
clients of the 2026-07-28 era hear of the same through `subscriptions/listen` (handlers/listen.py). A fleet
change is also when a standing GET stream of a token revoked meanwhile is ended: no request of its own would
reach the check.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcp.server.connection import Connection
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from tether.server.mcp.handlers.listen import FleetListen, ListsChanged
from tether.server.mcp.listing import DeviceFilter, FleetIndex
from tether.server.store import Store

logger = logging.getLogger(__name__)

MAX_WATCHED_SESSIONS = 10_000

Who = Callable[[ServerRequestContext[Any]], "tuple[DeviceFilter, str] | None"]  # a request's filter and token id
Sources = Callable[[str], frozenset[str]]  # a device's external MCP servers now (none while it is offline)


@dataclass
class _Watcher:
    """A handshake-era session to tell about tool-list changes, with its device filter."""

    connection: Connection
    keep: DeviceFilter
    token_id: str
    pending: set[str] = field(default_factory=set)  # the kinds of change not yet told


class ListChangedWatch:
    """The sessions to tell, remembered by `middleware` once initialized; `fleet_changed` is the hub's hook."""

    def __init__(self, manager: StreamableHTTPSessionManager, store: Store, index: FleetIndex,
                 listen: FleetListen, who: Who, sources: Sources, devices: Callable[[], list[str]]) -> None:
        self.manager, self.store, self.index, self.listen, self.who = manager, store, index, listen, who
        self.sources = sources
        self._watchers: dict[int, _Watcher] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # each device's external servers as last seen: a change of them changes its resources and prompts
        self._known: dict[str, frozenset[str]] = {name: sources(name) for name in devices()}

    async def middleware(self, ctx: ServerRequestContext[Any], call_next: CallNext) -> HandlerResult:
        """Remember each handshake-era session (once initialized) to tell it about tool-list changes."""
        result = await call_next(ctx)
        if ctx.method == "notifications/initialized" and ctx.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            self._remember(ctx)
        return result

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._watchers.clear()

    def _remember(self, ctx: ServerRequestContext[Any]) -> None:
        # the SDK hands handlers a per-request session; the per-connection state (its standalone stream and
        # the teardown stack run when the session ends) is the Connection it wraps
        connection: Connection | None = getattr(ctx.session, "_connection", None)
        admitted = self.who(ctx)
        if connection is None or admitted is None or len(self._watchers) >= MAX_WATCHED_SESSIONS:
            logger.warning("MCP gateway: session not watched for tool-list changes")
            return
        key = id(connection)
        self._watchers[key] = _Watcher(connection, *admitted)
        connection.exit_stack.callback(self._watchers.pop, key, None)

    def fleet_changed(self, device: str) -> None:
        self.index.invalidate()
        now = self.sources(device)
        kinds = {"tools"}
        if now != self._known.get(device, frozenset()):  # its servers came, went or changed
            kinds |= {"resources", "prompts"}
        if now:
            self._known[device] = now
        else:
            self._known.pop(device, None)
        self._spawn(self._tell_watchers(device, frozenset(kinds)))
        self.listen.publish(ListsChanged(frozenset(kinds), device))

    async def _tell_watchers(self, device: str, kinds: frozenset[str]) -> None:
        """The sessions watching `device` are told which of their lists changed, once the revoked tokens'
        sessions are ended (their statement off the event loop: `Store.call`)."""
        revoked = await self._end_revoked()
        for watcher in list(self._watchers.values()):
            if watcher.keep.admits(device) and watcher.token_id not in revoked:
                fresh = kinds - watcher.pending
                if fresh:
                    watcher.pending |= fresh
                    self._spawn(self._tell(watcher, fresh))

    async def _end_revoked(self) -> set[str]:
        """End the sessions of tokens revoked since they were opened (here or by `tether token revoke` in
        another process), so a standing GET stream does not outlive its token; returns those tokens' ids.

        Every request is checked anyway; this closes what no request reaches. Uses the SDK manager's session
        bookkeeping (`_session_owners`, `_server_instances`, `_discard_session`: mcp 2.3)."""
        owners: dict[str, Any] = getattr(self.manager, "_session_owners", {})
        if not owners:
            return set()
        active = await self.store.call(self.store.tokens.active_ids)
        owners = getattr(self.manager, "_session_owners", {})  # read again: the lookup may have waited
        revoked = {owner.get("client_id") for owner in owners.values()} - active
        instances: dict[str, Any] = getattr(self.manager, "_server_instances", {})
        for session_id, owner in list(owners.items()):
            transport = instances.get(session_id)
            if owner.get("client_id") in revoked and transport is not None:
                logger.info("MCP gateway: session of revoked token %s ended", owner.get("client_id"))
                self._spawn(self.manager._discard_session(session_id, transport))
        return {r for r in revoked if isinstance(r, str)}

    async def _tell(self, watcher: _Watcher, kinds: frozenset[str]) -> None:
        watcher.pending -= kinds
        # best effort: never raises
        if "tools" in kinds:
            await watcher.connection.send_tool_list_changed()
        if "resources" in kinds:
            await watcher.connection.send_resource_list_changed()
        if "prompts" in kinds:
            await watcher.connection.send_prompt_list_changed()

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
