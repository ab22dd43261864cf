"""The external MCP servers a device reaches: a Python module's `mcp` object in-process, a stdio
process, a streamable-HTTP endpoint, an (older) HTTP+SSE endpoint. Each is a `SessionServer`
(`mcp.servers`: one persistent session, supervised and restarted).

Apart from `mcp.manager` because these need the `mcp` SDK and the manager does not: a device whose
tools are all built in never imports this module (`create_server` does, for the first external entry).

A stdio server configured with `sandbox: true` is started inside the device's OS sandbox
(`ToolContext.sandbox`, through `tether.sandbox.confine.bwrap.live_argv`): the machine read-only except the
write roots, the device's secrets hidden, a private `/proc`, killed with the device. Its writes go
straight to the write roots (a server outlives every call, so they cannot be captured per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import shlex
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
import httpx2
import mcp_types
from mcp import Client, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError

from tether.device.mcp.client.base import MCPServerError
from tether.device.mcp.client.servers import SessionServer
from tether.device.mcp.client.session_util import describe_error, innermost_error, message_limit
from tether.device.mcp.client.stdio import bounded_stdio_client
from tether.device.mcp.config.server_config import MCPServerConfig

if TYPE_CHECKING:
    from tether.sandbox.egress.live import LiveEgress
    from tether.sandbox.runner import Sandbox

SandboxSource = Callable[[], "Sandbox | None"]

logger = logging.getLogger(__name__)


class _WatchedReadStream:
    """Reports the end of the server's side of a connection (process exit, HTTP transport failure)
    the moment the SDK's reader sees it, so a dead server is restarted even when no call waits on it."""

    def __init__(self, inner: Any, on_close: Callable[[], None]) -> None:
        self._inner = inner
        self._on_close = on_close

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_close()
            raise

    def __aiter__(self) -> _WatchedReadStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self._inner.__anext__()
        except (StopAsyncIteration, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_close()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _WatchedReadStream:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self._inner.__aexit__(*exc)

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)


@contextlib.asynccontextmanager
async def watch_transport(transport: Any, on_close: Callable[[], None]) -> AsyncIterator[tuple[Any, Any]]:
    async with transport as (read_stream, write_stream):
        yield _WatchedReadStream(read_stream, on_close), write_stream


class ModuleServer(SessionServer):
    """A Python module's `mcp` object (an `MCPServer` or low-level `Server`), connected in-process."""

    def __init__(self, config: MCPServerConfig) -> None:
        super().__init__(config)
        self._server_obj: Server[Any] | MCPServer | None = None

    def describe(self) -> str:
        return f"module {self.config.module}"

    async def start(self) -> None:
        if self._server_obj is None:
            try:
                module = importlib.import_module(str(self.config.module))
            except Exception as exc:
                raise MCPServerError(f"server '{self.namespace}' ({self.describe()}) failed to start: "
                                     f"import failed: {type(exc).__name__}: {exc}") from exc
            obj = getattr(module, "mcp", None)
            if not isinstance(obj, MCPServer | Server):
                raise MCPServerError(f"server '{self.namespace}': module {self.config.module} has no `mcp` "
                                     f"attribute holding an MCPServer or Server (found {type(obj).__name__})")
            self._server_obj = obj
        await super().start()

    def _open(self, generation: int) -> contextlib.AbstractAsyncContextManager[Client]:
        assert self._server_obj is not None
        return Client(self._server_obj, **self._client_options())


class _StderrTail(asyncio.Protocol):
    """The last few KB a stdio server wrote to stderr: what explains why it failed to start or died."""

    def __init__(self, namespace: str, limit: int = 4096) -> None:
        self.namespace = namespace
        self.limit = limit
        self.data = bytearray()
        self.eof = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data
        if len(self.data) > self.limit:
            del self.data[: -self.limit]
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("server %s stderr: %s", self.namespace, data.decode(errors="replace").rstrip())

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof.set()

    def text(self, max_chars: int = 1000) -> str:
        text = self.data.decode(errors="replace").strip()
        return text if len(text) <= max_chars else "..." + text[-max_chars:]


def _no_sandbox() -> Sandbox | None:
    return None


class StdioServer(SessionServer):
    """A command speaking MCP on stdin/stdout, run in its own process group (the SDK kills the tree);
    inside the device's sandbox when its config says `sandbox: true`."""

    lost_words = "died"

    def __init__(self, config: MCPServerConfig, sandbox: SandboxSource = _no_sandbox) -> None:
        super().__init__(config)
        self._sandbox = sandbox
        self._stderr: _StderrTail | None = None
        self._stderr_transport: asyncio.ReadTransport | None = None

    def describe(self) -> str:
        command = shlex.join([str(self.config.command), *self.config.args])
        return f"{command}, sandboxed" if self.config.sandbox else command

    def _argv(self, egress_fd: int | None = None) -> list[str]:
        """The command line to start: the configured one, or bwrap running it when sandboxed
        (`egress_fd`: the channel its egress proxy port comes back on, see `_live_egress`).

        Raises `MCPServerError` when the config asks for a sandbox and the device has none: the server
        must not quietly run unconfined."""
        argv = [str(self.config.command), *self.config.args]
        if not self.config.sandbox:
            return argv
        sandbox = self._sandbox()
        if sandbox is None:
            raise MCPServerError(f"server '{self.namespace}' ({self.describe()}) failed to start: its config "
                                 f"says 'sandbox: true' but this device has no sandbox (install bubblewrap and "
                                 f"allow unprivileged user namespaces, or remove 'sandbox' to run it unconfined)")
        from tether.sandbox.confine.bwrap import live_argv  # only a sandboxed server needs it

        return live_argv(sandbox.spec, argv, cwd=self.config.cwd, bwrap=sandbox.info.bwrap or "bwrap",
                         egress_fd=egress_fd, hide=sandbox.live_hidden())

    def _live_egress(self) -> LiveEgress | None:
        """The way to the device's egress proxy for a sandboxed server when the policy lists hosts (its
        sandbox has no direct network then), else None."""
        sandbox = self._sandbox() if self.config.sandbox else None
        proxy = getattr(sandbox, "egress", None)  # a source may offer only the spec and info (no proxy)
        if sandbox is None or proxy is None or sandbox.spec.network:
            return None
        from tether.sandbox.egress.live import LiveEgress

        return LiveEgress(proxy)

    async def start(self) -> None:
        self._argv()  # a missing sandbox is a clear start error, not a failed handshake
        await super().start()

    def _explain(self, exc: BaseException | None) -> str:
        leaf = innermost_error(exc)
        if isinstance(leaf, MCPError) and leaf.code == mcp_types.CONNECTION_CLOSED:
            return "the process exited before completing the MCP handshake"
        if isinstance(leaf, FileNotFoundError) and leaf.filename == self.config.command:
            return f"command not found: {self.config.command!r}"
        return describe_error(exc)

    async def _diagnostics(self, wait: bool) -> str:
        tail = self._stderr
        if tail is None:
            return ""
        if wait and not tail.eof.is_set():  # the process is gone; its stderr EOF is imminent
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tail.eof.wait(), 0.5)
        text = tail.text()
        return f"; stderr: {text}" if text else ""

    @contextlib.asynccontextmanager
    async def _open(self, generation: int) -> AsyncIterator[Client]:
        egress = self._live_egress()
        try:
            command, *args = self._argv(egress.child_fd if egress is not None else None)
        except BaseException:
            if egress is not None:
                egress.close()
            raise
        params = StdioServerParameters(command=command, args=args, env=self.config.env, cwd=self.config.cwd)
        if self._stderr_transport is not None:
            self._stderr_transport.close()
        read_fd, write_fd = os.pipe()
        tail = self._stderr = _StderrTail(self.namespace)
        loop = asyncio.get_running_loop()
        self._stderr_transport, _ = await loop.connect_read_pipe(lambda: tail, os.fdopen(read_fd, "rb", 0))
        errlog = os.fdopen(write_fd, "w")
        try:
            limit = message_limit(self.config.max_result_bytes)
            if egress is not None:
                egress.listen()
            fds = (egress.child_fd,) if egress is not None else ()
            transport = watch_transport(bounded_stdio_client(params, errlog, limit, pass_fds=fds),
                                        lambda: self._on_stream_closed(generation))
            async with Client(transport, **self._client_options()) as client:
                errlog.close()  # the child has its own copy; ours would hold the pipe open forever
                if egress is not None:
                    egress.started()
                yield client
        finally:
            errlog.close()
            if egress is not None:
                egress.close()

    async def close(self) -> None:
        await super().close()
        if self._stderr_transport is not None:
            self._stderr_transport.close()


class HttpServer(SessionServer):
    """A streamable-HTTP endpoint; `headers` go on every request (e.g. Authorization)."""

    def __init__(self, config: MCPServerConfig) -> None:
        super().__init__(config)
        self._refused: int | None = None  # the last HTTP error status: the SDK only says "an error response"

    def describe(self) -> str:
        return str(self.config.url)

    def _explain(self, exc: BaseException | None) -> str:
        why = describe_error(exc)
        if self._refused in (401, 403):
            return f"{why}: the server answered HTTP {self._refused} (check the entry's 'headers')"
        return f"{why}: the server answered HTTP {self._refused}" if self._refused else why

    async def _note_status(self, response: httpx2.Response) -> None:
        self._refused = response.status_code if response.status_code >= 400 else self._refused

    @contextlib.asynccontextmanager
    async def _open(self, generation: int) -> AsyncIterator[Client]:
        # The SDK's own defaults: 30 s to connect/write, 300 s to read (SSE streams stay open).
        timeout = httpx2.Timeout(30.0, read=300.0)
        self._refused = None
        async with httpx2.AsyncClient(headers=self.config.headers, timeout=timeout,
                                      event_hooks={"response": [self._note_status]}) as http:
            transport = watch_transport(streamable_http_client(str(self.config.url), http_client=http),
                                        lambda: self._on_stream_closed(generation))
            async with Client(transport, **self._client_options()) as client:
                yield client


class SseServer(SessionServer):
    """The HTTP+SSE transport (MCP 2024-11-05) that desktop configs still name `type: sse`; `headers` go on
    the event stream and on every POST."""

    def describe(self) -> str:
        return str(self.config.url)

    @contextlib.asynccontextmanager
    async def _open(self, generation: int) -> AsyncIterator[Client]:
        # as HttpServer: 30 s to connect/write, 300 s between events on the open stream
        transport = watch_transport(sse_client(str(self.config.url), headers=dict(self.config.headers),
                                               timeout=30.0, sse_read_timeout=300.0),
                                    lambda: self._on_stream_closed(generation))
        async with Client(transport, **self._client_options()) as client:
            yield client
