"""The MCP servers a device calls tools on, each behind one `BaseMCPServer` interface: an external one's calls.

Built-in tool sets are called directly (no MCP session on the hot path; see `mcp.toolset_server`).
External servers — a Python module's `mcp` object in-process, a stdio process, a streamable-HTTP
endpoint — get one persistent `mcp.Client` session each, kept by a supervisor task (`supervised.py`).
Calls from any task use the published session; none of them ever raises:
every failure is a `Result(status=FAILURE)` naming the server and the tool.

External servers' tools are under the device config's rules (`mcp.tool_rules`): denied tools are
never listed nor called, read-only ones are typed `data_collection`, and a tool that needs a
person's approval fails with the same `needs_approval` result a built-in tool gives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import mcp_types
from mcp import Client
from mcp.shared.exceptions import MCPError

from tether.device.mcp.client.base import MCPServerError
from tether.device.mcp.client.session_util import describe_error, result_size
from tether.device.mcp.client.stdio import TOO_LARGE
from tether.device.mcp.client.supervised import SupervisedSession
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.device.mcp.config.tool_rules import annotated_type
from tether.protocol.models import Result, ToolInfo, ToolType
from tether.tools.context import ToolContext
from tether.tools.errors import ToolError
from tether.tools.toolsets.mcp_export import call_result_to_result, is_result_wrapper, result_shape_schema

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SessionServer(SupervisedSession):
    """An external MCP server behind one persistent session, owned by a supervisor task."""

    def __init__(self, config: MCPServerConfig) -> None:
        super().__init__(config)
        self._wrapped: set[str] = set()
        # each tool's MCP annotations as last listed: they decide its type and whether it needs approval
        self._annotations: dict[str, mcp_types.ToolAnnotations | None] = {}
        # tools whose calls the config's rules neither deny nor hold for a person, with the annotations
        # as last listed: checked on a tool's first call and again after each listing
        self._cleared: set[str] = set()

    def _note_tools(self, tools: list[mcp_types.Tool]) -> None:
        self._wrapped.update(t.name for t in tools if is_result_wrapper(t.output_schema))
        self._annotations.update((t.name, t.annotations) for t in tools)
        self._cleared.clear()  # annotations may have changed: each tool's approval is decided again

    async def call_tool(self, name: str, arguments: dict[str, Any] | None, *, ctx: ToolContext,
                        timeout: float | None) -> Result:
        if name not in self._cleared:  # before anything starts: a denied call never reaches it
            denied = self.tool_policy.refusal(name)
            if denied is not None:
                return self._failure(f"{name}: {denied}", ctx, denied.result)
        limit = timeout or self.config.timeout or ctx.policy.default_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        client = self._client if self._ready.is_set() and not self._reset_pending else None
        if client is None:
            client, why = await self._await_client(deadline)
            if client is None:
                return self._failure(f"{why}; call '{name}' not sent", ctx)
        if name not in self._cleared:  # annotations are known once a session is open (it lists tools first)
            held = self.tool_policy.approval(name, self._annotations.get(name))
            if held is None:
                self._cleared.add(name)  # neither denied nor held: not asked again until the next listing
            elif not ctx.approved_by:
                return self._failure(f"{name}: {held}", ctx, held.result)
        gen = self._generation
        remaining = max(deadline - loop.time(), 0.001)
        caps = self.caps
        try:
            tracked = caps.track(ctx)
            try:
                # The SDK's read timeout ends the request, but starts only once the request is handed to the
                # transport's one writer: a call behind a writer stuck on a full pipe (a server that stopped
                # reading a large request) would wait for ever. The outer one bounds that, unless the caller's
                # own timeout (its batch's) stops the call before it would (test_mcp_servers' never_reads test).
                guard = remaining + 1.0
                progress = caps.progress_callback(ctx, name)
                if ctx.deadline is not None and ctx.deadline < loop.time() + guard:
                    result = await client.call_tool(name, arguments, read_timeout_seconds=remaining,
                                                    progress_callback=progress)
                else:
                    async with asyncio.timeout(guard):
                        result = await client.call_tool(name, arguments, read_timeout_seconds=remaining,
                                                        progress_callback=progress)
            finally:
                caps.untrack(tracked, ctx)
        except asyncio.CancelledError:
            if ctx.deadline is not None and loop.time() >= ctx.deadline - 0.01:  # a timer may fire a hair early
                self._mark_lost(gen)  # its batch's timeout ended it: reset as a timed-out call (`_timed_out`)
            raise
        except MCPError as exc:
            if exc.code == mcp_types.CONNECTION_CLOSED:
                self._mark_lost(gen)
                return self._failure(f"server '{self.namespace}' {self.lost_words} during call '{name}'"
                                     f"{await self._diagnostics(wait=True)}", ctx)
            if exc.code == mcp_types.REQUEST_TIMEOUT:
                return self._timed_out(name, limit, gen, ctx)
            if exc.code == TOO_LARGE:
                data = exc.data if isinstance(exc.data, dict) else {"too_large": True}
                return self._failure(f"server '{self.namespace}': call '{name}' failed: {exc.message}", ctx, data)
            return self._failure(f"server '{self.namespace}': call '{name}' failed: {exc.message} "
                                 f"(MCP error {exc.code})", ctx)
        except TimeoutError:
            return self._timed_out(name, limit, gen, ctx)
        except Exception as exc:
            return self._failure(f"server '{self.namespace}': call '{name}' failed: "
                                 f"{describe_error(exc)}", ctx)
        cap = self.config.max_result_bytes
        size = result_size(result, cap)
        if size > cap:  # an in-process or HTTP server: the transport did not bound it
            return self._failure(f"server '{self.namespace}': call '{name}' failed: result too large: "
                                 f"{size} bytes, over the limit of {cap} bytes (max_result_bytes); ask for less "
                                 f"(a narrower query, a page, a file to read in parts)", ctx,
                                 {"too_large": True, "bytes": size, "limit": cap, "complete": True})
        return call_result_to_result(result, server=self.namespace, tool=name, call_id=ctx.call_id,
                                     unwrap=name in self._wrapped)

    async def session_request(self, what: str, request: Callable[[Client], Awaitable[T]], timeout: float) -> T:
        client, why = await self._await_client(asyncio.get_running_loop().time() + timeout)
        if client is None:
            raise ToolError(f"{why}; {what} not sent")
        gen = self._generation
        try:
            async with asyncio.timeout(timeout):
                return await request(client)
        except TimeoutError:
            self._mark_lost(gen)  # as a timed-out call: the session may be busy behind it
            raise ToolError(f"server '{self.namespace}': {what} timed out after {timeout:g}s (its session "
                            "was reset)") from None
        except Exception as exc:
            if isinstance(exc, MCPError) and exc.code == mcp_types.CONNECTION_CLOSED:
                self._mark_lost(gen)
            why = exc.message if isinstance(exc, MCPError) and str(exc.code) in exc.message else describe_error(exc)
            raise ToolError(f"server '{self.namespace}': {what} failed: {why}") from None

    def _timed_out(self, name: str, limit: float, generation: int, ctx: ToolContext) -> Result:
        """A call that timed out may leave the session busy (a server still computing or still sending a
        huge answer the next call would wait behind): the session is reset, so the next call gets a
        fresh one."""
        logger.info("server %s: call '%s' timed out after %gs; resetting its session", self.namespace, name, limit)
        self._mark_lost(generation)
        return self._failure(f"server '{self.namespace}': call '{name}' timed out after {limit:g}s (its session "
                             f"was reset)", ctx, {"timed_out": True, "timeout": limit})

    async def list_tools(self, tool_type: ToolType) -> list[ToolInfo]:
        loop = asyncio.get_running_loop()
        client, why = await self._await_client(loop.time() + self.config.startup_timeout)
        if client is None:
            raise MCPServerError(why)
        gen = self._generation
        tools: list[mcp_types.Tool] = []
        cursor: str | None = None
        try:
            async with asyncio.timeout(self._request_timeout):
                for _ in range(100):  # a paginator that never ends must not hang registration
                    page = await client.list_tools(cursor=cursor, cache_mode="refresh")
                    tools.extend(page.tools)
                    cursor = page.next_cursor
                    if not cursor:
                        break
        except Exception as exc:
            if isinstance(exc, MCPError) and exc.code == mcp_types.CONNECTION_CLOSED:
                self._mark_lost(gen)
            raise MCPServerError(f"server '{self.namespace}': listing tools failed: "
                                 f"{describe_error(exc)}") from exc
        self._note_tools(tools)
        tools = self._without_task_only(tools)
        rules = self.tool_policy
        unknown = sorted(rules.named - {t.name for t in tools})
        if unknown:  # most likely a typo in the config, which would otherwise fail silently
            logger.warning("server %s: the config names tools it does not offer: %s", self.namespace,
                           ", ".join(unknown))
        return [ToolInfo(name=t.name, namespace=self.namespace, tool_type=annotated_type(t.annotations, tool_type),
                         description=t.description or "", input_schema=dict(t.input_schema),
                         output_schema=result_shape_schema(t.output_schema, t.name in self._wrapped),
                         title=t.title, annotations=t.annotations.model_dump(mode="json", by_alias=True,
                                                                             exclude_none=True)
                         if t.annotations is not None else None)
                for t in tools if rules.visible(t.name)]

    def _without_task_only(self, tools: list[mcp_types.Tool]) -> list[mcp_types.Tool]:
        """A tool whose `execution.taskSupport` is "required" answers only task-augmented calls, which
        tether does not make: listing it would offer a tool that always fails."""
        dropped = {t.name for t in tools if t.execution is not None and t.execution.task_support == "required"}
        if dropped:
            logger.info("server %s: not listing %s: they require task-augmented calls (execution.taskSupport "
                        "'required'), which tether does not make", self.namespace, ", ".join(sorted(dropped)))
        return [t for t in tools if t.name not in dropped]
