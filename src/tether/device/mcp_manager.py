"""How a device reaches each kind of MCP server, and the manager that owns them all.

`MCPServerManager` builds one server object per distinct config (seed 003's
`create_or_get_server`), starts them in parallel, restarts the ones marked `reset` when the
device is reset, and closes everything (killing stdio processes) on `aclose`. The server
classes here are the external transports; the supervision they share is in `mcp_servers`.

A stdio server configured with `sandbox: true` is started inside the device's OS sandbox
(`ToolContext.sandbox`, through `tether.sandbox.bwrap.live_argv`): the machine read-only except the
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
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import httpx2
import mcp_types
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.server import Server
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError

from tether.device.mcp_client_caps import MCPClientHooks, ServerClientCaps
from tether.device.mcp_config import MCPServerConfig
from tether.device.mcp_servers import (
    BaseMCPServer,
    MCPServerError,
    SessionServer,
    describe_error,
    innermost_error,
    message_limit,
)
from tether.device.mcp_stdio import bounded_stdio_client
from tether.device.toolset_server import ToolSetServer
from tether.tools.context import ToolContext
from tether.tools.optional import MissingDependency
from tether.tools.runtime import ToolSet

if TYPE_CHECKING:
    from tether.sandbox.runner import Sandbox

SandboxSource = Callable[[], "Sandbox | None"]

__all__ = [
    "BaseMCPServer",
    "HttpServer",
    "MCPServerError",
    "MCPServerManager",
    "ModuleServer",
    "StdioServer",
    "ToolSetServer",
    "create_server",
]

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

    def _argv(self) -> list[str]:
        """The command line to start: the configured one, or bwrap running it when sandboxed.

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
        from tether.sandbox.bwrap import live_argv  # only a sandboxed server needs it

        return live_argv(sandbox.spec, argv, cwd=self.config.cwd, bwrap=sandbox.info.bwrap or "bwrap")

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
        command, *args = self._argv()
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
            transport = watch_transport(bounded_stdio_client(params, errlog, limit),
                                        lambda: self._on_stream_closed(generation))
            async with Client(transport, **self._client_options()) as client:
                errlog.close()  # the child has its own copy; ours would hold the pipe open forever
                yield client
        finally:
            errlog.close()

    async def close(self) -> None:
        await super().close()
        if self._stderr_transport is not None:
            self._stderr_transport.close()


class HttpServer(SessionServer):
    """A streamable-HTTP endpoint; `headers` go on every request (e.g. Authorization)."""

    def describe(self) -> str:
        return str(self.config.url)

    @contextlib.asynccontextmanager
    async def _open(self, generation: int) -> AsyncIterator[Client]:
        # The SDK's own defaults: 30 s to connect/write, 300 s to read (SSE streams stay open).
        timeout = httpx2.Timeout(30.0, read=300.0)
        async with httpx2.AsyncClient(headers=self.config.headers, timeout=timeout) as http:
            transport = watch_transport(streamable_http_client(str(self.config.url), http_client=http),
                                        lambda: self._on_stream_closed(generation))
            async with Client(transport, **self._client_options()) as client:
                yield client


def create_server(config: MCPServerConfig, toolsets: Mapping[str, Callable[[], ToolSet]] | None = None,
                  sandbox: SandboxSource = _no_sandbox) -> BaseMCPServer:
    """The server object for one config entry; nothing is started yet."""
    toolsets = toolsets or {}
    if config.server_type == "stdio":
        return StdioServer(config, sandbox)
    if config.server_type == "http":
        return HttpServer(config)
    if config.toolset:
        return ToolSetServer(config, toolsets.get(config.toolset), known=toolsets)
    return ModuleServer(config)


class MCPServerManager:
    """Every MCP server of one device. Entries with the same `identity()` share one server (and one
    session); `reset=True` gives each `process_name` its own. `context` is the device's tool context:
    its `sandbox` confines the stdio servers configured with `sandbox: true`."""

    def __init__(self, toolsets: Mapping[str, Callable[[], ToolSet]] | None = None, *,
                 context: ToolContext | None = None, hooks: MCPClientHooks | None = None) -> None:
        self._toolsets: dict[str, Callable[[], ToolSet]] = dict(toolsets or {})
        self._servers: dict[tuple[str, str | None], BaseMCPServer] = {}
        self.context = context
        # who answers external servers' questions and sampling requests (`mcp_client_caps`)
        self.hooks = hooks or MCPClientHooks()

    def _sandbox(self) -> Sandbox | None:
        # read when a server starts, not when the manager is made: the device may open its sandbox later
        return self.context.sandbox if self.context is not None else None

    @property
    def servers(self) -> list[BaseMCPServer]:
        return list(self._servers.values())

    def create_or_get_server(self, mcp_config: MCPServerConfig | dict[str, Any], reset: bool = False,
                             process_name: str | None = None) -> BaseMCPServer:
        config = (mcp_config if isinstance(mcp_config, MCPServerConfig)
                  else MCPServerConfig.model_validate(mcp_config))
        key = (config.identity(), process_name if reset else None)
        server = self._servers.get(key)
        if server is None:
            server = self._servers[key] = create_server(config, self._toolsets, self._sandbox)
            if isinstance(server, SessionServer):
                server.caps = ServerClientCaps(server.namespace, self.hooks, lambda: self.context)
        return server

    async def start_servers(self, servers: Iterable[BaseMCPServer | MCPServerConfig | dict[str, Any]]
                            ) -> dict[str, str]:
        """Start all at once (one slow server does not delay the others); return namespace -> error
        for the ones that failed, so a device comes up with whatever works."""
        unique: dict[int, BaseMCPServer] = {}
        invalid: dict[str, str] = {}
        for item in servers:
            try:
                server = item if isinstance(item, BaseMCPServer) else self.create_or_get_server(item)
            except ValueError as exc:  # a bad entry is that entry's failure, not everyone's
                name = item.namespace if isinstance(item, MCPServerConfig) else str(item.get("namespace", "?"))
                invalid[name] = f"server '{name}': invalid configuration: {exc}"
                continue
            unique[id(server)] = server

        async def start(server: BaseMCPServer) -> str | None:
            try:
                await server.start()
            except Exception as exc:
                # an optional tool set (desktop, browser) missing its extra is expected, not alarming
                optional = isinstance(exc.__cause__, MissingDependency)
                logger.log(logging.INFO if optional else logging.WARNING, "%s", exc)
                return str(exc) if isinstance(exc, MCPServerError) else (
                    f"server '{server.namespace}' failed to start: {describe_error(exc)}")
            return None

        errors = await asyncio.gather(*(start(s) for s in unique.values()))
        failed = {s.namespace: e for s, e in zip(unique.values(), errors, strict=True) if e is not None}
        return invalid | failed

    async def roots_changed(self, context: ToolContext) -> None:
        """A new policy (and so new roots): servers with an open session are told `roots/list_changed`."""
        self.context = context
        for server in self._servers.values():
            if isinstance(server, SessionServer):
                await server.notify_roots_changed()

    def reset(self) -> None:
        """Mark the servers configured with `reset: true` to restart before their next call."""
        for server in self._servers.values():
            if server.config.reset:
                server.request_reset()

    async def check_health(self, timeout: float = 5.0) -> dict[str, bool]:
        """`tools/list` on every server in parallel; failing ones are restarted in the background."""
        servers = list(self._servers.values())
        results = await asyncio.gather(*(s.health_check(timeout) for s in servers))
        return {s.namespace: ok for s, ok in zip(servers, results, strict=True)}

    async def aclose(self) -> None:
        servers, self._servers = list(self._servers.values()), {}
        results = await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
        for server, result in zip(servers, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("closing server %s failed: %s", server.namespace, describe_error(result))
