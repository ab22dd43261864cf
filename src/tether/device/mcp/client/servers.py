"""The MCP servers a device calls tools on, each behind one `BaseMCPServer` interface.

Built-in tool sets are called directly (no MCP session on the hot path; see `mcp.toolset_server`).
External servers — a Python module's `mcp` object in-process, a stdio process, a streamable-HTTP
endpoint — get one persistent `mcp.Client` session each. anyio requires an `async with Client(...)` to be entered and
exited by the same task, so every external server has a supervisor task that owns the session,
notices when it ends (the process died, the HTTP transport failed) and opens a new one with
exponential backoff. Calls from any task use the published session; none of them ever raises:
every failure is a `Result(status=FAILURE)` naming the server and the tool.

External servers' tools are under the device config's rules (`mcp.tool_rules`): denied tools are
never listed nor called, read-only ones are typed `data_collection`, and a tool that needs a
person's approval fails with the same `needs_approval` result a built-in tool gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import mcp_types
from mcp import Client
from mcp.shared.exceptions import MCPError

from tether.device.mcp.client.base import BaseMCPServer, MCPServerError
from tether.device.mcp.client.client_caps import MCPClientHooks, ServerClientCaps
from tether.device.mcp.client.session_util import describe_error, innermost_error, message_limit, result_size
from tether.device.mcp.client.stdio import TOO_LARGE
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.device.mcp.config.tool_rules import annotated_type
from tether.errors import DeviceError
from tether.protocol.models import Result, ToolInfo, ToolType
from tether.tools.context import ToolContext
from tether.tools.errors import ToolError
from tether.tools.mcp_export import call_result_to_result, is_result_wrapper, result_shape_schema
from tether.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0  # for requests that have no per-call timeout (tools/list); the SDK has none
BACKOFF_BASE = 0.2
BACKOFF_CAP = 30.0
MIN_UPTIME = 1.0  # a session that dies sooner counts as a failed start (crash loops back off)
_CLIENT_INFO = mcp_types.Implementation(name="tether", version=__version__)
T = TypeVar("T")
__all__ = ["SessionServer", "describe_error", "innermost_error", "message_limit", "result_size"]  # re-exported


class _OpenFailed(DeviceError):
    pass


class SessionServer(BaseMCPServer):
    """An external MCP server behind one persistent session, owned by a supervisor task."""

    lost_words = "lost its connection"

    def __init__(self, config: MCPServerConfig) -> None:
        super().__init__(config)
        self.last_error: str | None = None
        self._client: Client | None = None
        self._ready = asyncio.Event()
        self._closed = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._open_scope: anyio.CancelScope | None = None
        self._generation = 0
        self._first: asyncio.Future[None] | None = None
        self._opened_once = False
        self._wrapped: set[str] = set()
        # each tool's MCP annotations as last listed: they decide its type and whether it needs approval
        self._annotations: dict[str, mcp_types.ToolAnnotations | None] = {}
        # tools whose calls the config's rules neither deny nor hold for a person, with the annotations
        # as last listed: checked on a tool's first call and again after each listing
        self._cleared: set[str] = set()
        # progress, questions, sampling, roots and logs of this server (`mcp.client_caps`); the manager
        # gives it the device's hooks and context
        self.caps = ServerClientCaps(self.namespace, MCPClientHooks(), lambda: None)

    @property
    def healthy(self) -> bool:
        return self._ready.is_set() and not self._closed.is_set()

    @property
    def _request_timeout(self) -> float:
        return self.config.timeout or DEFAULT_TIMEOUT

    @abstractmethod
    def _open(self, generation: int) -> contextlib.AbstractAsyncContextManager[Client]:
        """Open one session; the supervisor enters and exits it in its own task."""

    async def _diagnostics(self, wait: bool) -> str:
        """Extra context for an error message (a stdio server's stderr)."""
        return ""

    def _explain(self, exc: BaseException | None) -> str:
        return describe_error(exc)

    async def start(self) -> None:
        if self._closed.is_set():
            raise MCPServerError(f"server '{self.namespace}' is closed")
        if self._task is None or self._task.done():
            created = self._first = asyncio.get_running_loop().create_future()
            created.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, never warned
            self._task = asyncio.create_task(self._supervise(created), name=f"mcp-server:{self.namespace}")
        first = self._first
        assert first is not None
        await asyncio.shield(first)  # concurrent starters share one attempt and its outcome

    async def _supervise(self, first: asyncio.Future[None]) -> None:
        try:
            await self._supervise_loop(first)
        except Exception as exc:  # a bug here must not leave start() waiting forever
            logger.exception("server %s: supervisor failed", self.namespace)
            if not first.done():
                first.set_exception(MCPServerError(f"server '{self.namespace}' failed to start: "
                                                   f"{describe_error(exc)}"))
        finally:
            self._ready.clear()

    async def _supervise_loop(self, first: asyncio.Future[None]) -> None:
        failures = 0
        while not self._closed.is_set():
            try:
                uptime = await self._run_session(first)
            except _OpenFailed as exc:
                self.last_error = str(exc)
                if not first.done():  # the first start failed: report it and stop, nothing to restart
                    first.set_exception(MCPServerError(str(exc)))
                    return
                failures += 1
                logger.warning("%s", exc)
            else:
                failures = 0 if uptime >= MIN_UPTIME else failures + 1
            if self._closed.is_set():
                return
            delay = 0.0 if failures == 0 else min(BACKOFF_BASE * 2 ** (failures - 1), BACKOFF_CAP)
            if delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closed.wait(), delay)

    async def _run_session(self, first: asyncio.Future[None]) -> float:
        """Open a session, publish it, hold it until it is lost or stopped; return its uptime."""
        self._generation += 1
        gen = self._generation
        stop = self._stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        opened_at: float | None = None
        error: BaseException | None = None
        with anyio.CancelScope(deadline=anyio.current_time() + self.config.startup_timeout) as scope:
            self._open_scope = scope
            try:
                async with self._open(gen) as client:
                    # Listing proves the session works and primes the SDK's output-schema cache.
                    self._note_tools((await client.list_tools()).tools)
                    scope.deadline = math.inf
                    self._open_scope = None
                    opened_at = loop.time()
                    self._client = client
                    if self._opened_once:
                        self.restarts += 1
                    self._opened_once = True
                    self.last_error = None
                    self._ready.set()
                    if not first.done():
                        first.set_result(None)
                    await stop.wait()
                    self._ready.clear()
                    self._client = None
            except Exception as exc:  # includes the ExceptionGroups anyio task groups raise
                error = exc
            finally:
                self._ready.clear()
                self._client = None
                self._open_scope = None
        if opened_at is not None:
            if error is not None:
                logger.debug("server %s: session ended with %r", self.namespace, error)
            return loop.time() - opened_at
        if self._closed.is_set():
            raise _OpenFailed(f"server '{self.namespace}' was closed while starting")
        if scope.cancelled_caught:
            reason = f"no MCP handshake within {self.config.startup_timeout:g}s (startup_timeout)"
        else:
            reason = self._explain(error)
        raise _OpenFailed(f"server '{self.namespace}' ({self.describe()}) failed to start: {reason}"
                          f"{await self._diagnostics(wait=True)}")

    def _note_tools(self, tools: list[mcp_types.Tool]) -> None:
        self._wrapped.update(t.name for t in tools if is_result_wrapper(t.output_schema))
        self._annotations.update((t.name, t.annotations) for t in tools)
        self._cleared.clear()  # annotations may have changed: each tool's approval is decided again

    def _on_stream_closed(self, generation: int) -> None:
        if generation == self._generation and not self._closed.is_set():
            logger.info("server %s: connection closed; restarting", self.namespace)
            self._mark_lost(generation)

    def _mark_lost(self, generation: int) -> None:
        if generation == self._generation:
            self._ready.clear()
            self._stop.set()

    async def _await_client(self, deadline: float) -> tuple[Client | None, str]:
        """Slow path: start, reset or wait out a restart, bounded by the call's deadline."""
        loop = asyncio.get_running_loop()
        if self._closed.is_set():
            return None, f"server '{self.namespace}' is closed"
        if self._reset_pending:
            self._reset_pending = False
            if self._task is not None and not self._task.done():
                self._mark_lost(self._generation)
        if self._task is None or self._task.done():
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0)):
                    await self.start()
            except TimeoutError:
                return None, f"server '{self.namespace}' did not start within the call's timeout"
            except MCPServerError as exc:
                return None, str(exc)
        if not self._ready.is_set():
            waiters = {asyncio.ensure_future(self._ready.wait()), asyncio.ensure_future(self._closed.wait())}
            _, pending = await asyncio.wait(waiters, timeout=max(deadline - loop.time(), 0),
                                            return_when=asyncio.FIRST_COMPLETED)
            for waiter in pending:
                waiter.cancel()
        client = self._client
        if client is not None and self.healthy:
            return client, ""
        if self._closed.is_set():
            return None, f"server '{self.namespace}' is closed"
        last = f" (last error: {self.last_error})" if self.last_error else ""
        return None, f"server '{self.namespace}' is restarting and was not ready in time{last}"

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

    async def health_check(self, timeout: float = 5.0) -> bool:
        """`tools/list` rather than ping: ping fails against mcp>=2 servers on the modern protocol."""
        client, gen = self._client, self._generation
        if client is None or not self.healthy:
            return False
        try:
            async with asyncio.timeout(timeout):
                await client.list_tools(cache_mode="bypass")
        except Exception as exc:
            logger.warning("server %s failed its health check: %s", self.namespace, describe_error(exc))
            self._mark_lost(gen)
            return False
        return True

    async def notify_roots_changed(self) -> None:
        """Tell an open session its roots changed; a server not running reads them when it starts."""
        client = self._client
        if client is None or not self.healthy:
            return
        try:
            async with asyncio.timeout(self._request_timeout):
                await client.send_roots_list_changed()
        except Exception as exc:
            logger.info("server %s: roots/list_changed not sent: %s", self.namespace, describe_error(exc))

    async def close(self) -> None:
        self._closed.set()
        self._ready.clear()
        self._stop.set()
        if self._open_scope is not None:
            self._open_scope.cancel()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(Exception):
                await task

    def _client_options(self) -> dict[str, Any]:
        return {"read_timeout_seconds": self._request_timeout, "client_info": _CLIENT_INFO,
                **self.caps.client_options()}

