"""The session an external MCP server is reached through, owned by one supervisor task.

anyio requires an `async with Client(...)` to be entered and exited by the same task, so every external server
has a supervisor task that owns the session, notices when it ends (the process died, the HTTP transport failed)
and opens a new one with exponential backoff. Callers get the published session (`_await_client`), or wait out a
restart bounded by their own deadline; the calls themselves are `servers.SessionServer`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from abc import abstractmethod
from typing import Any

import anyio
import mcp_types
from mcp import Client

from tether.device.mcp.client.base import BaseMCPServer, MCPServerError
from tether.device.mcp.client.client_caps import MCPClientHooks, ServerClientCaps
from tether.device.mcp.client.session_util import describe_error
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.errors import DeviceError
from tether.version import __version__

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 60.0  # for requests that have no per-call timeout (tools/list); the SDK has none
BACKOFF_BASE = 0.2
BACKOFF_CAP = 30.0
MIN_UPTIME = 1.0  # a session that dies sooner counts as a failed start (crash loops back off)
_CLIENT_INFO = mcp_types.Implementation(name="tether", version=__version__)


class _OpenFailed(DeviceError):
    pass


class SupervisedSession(BaseMCPServer):
    """An external MCP server's one persistent session, opened, watched and reopened by a supervisor task.

    A subclass gives `_open` (one session of its transport) and may give `_diagnostics`, `_explain` and
    `_note_tools` (the tools each new session listed)."""

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
        """The tools a new session listed (before it is published); nothing here."""

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
