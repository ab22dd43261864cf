"""The manager that owns every MCP server of a device.

`MCPServerManager` builds one server object per distinct config (seed 003's
`create_or_get_server`), starts them in parallel, restarts the ones marked `reset` when the
device is reset, and closes everything (killing stdio processes) on `aclose`. Built-in tool sets are
`ToolSetServer`s; the external transports (module, stdio, HTTP) live in `mcp.external` and the
supervision they share in `mcp.servers`. Those need the `mcp` SDK, so they are imported when the first
external server is created, never by a device whose tools are all built in (importing `mcp` is a large part of a
`tether device` or `tether exec` start).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from tether.device.mcp.client.base import BaseMCPServer, MCPServerError
from tether.device.mcp.client.client_caps import MCPClientHooks
from tether.device.mcp.client.toolset_server import ToolSetServer
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.tools.context import ToolContext
from tether.tools.errors import MissingDependency
from tether.tools.runtime import ToolSet

if TYPE_CHECKING:
    from tether.sandbox.runner import Sandbox

SandboxSource = Callable[[], "Sandbox | None"]

__all__ = ["BaseMCPServer", "MCPServerError", "MCPServerManager", "ToolSetServer", "create_server"]

logger = logging.getLogger(__name__)

_EXTERNAL = ("HttpServer", "ModuleServer", "SseServer", "StdioServer", "watch_transport")


def __getattr__(name: str) -> Any:
    """The external server classes, still importable from here, loaded (with `mcp`) on first use."""
    if name in _EXTERNAL:
        return getattr(importlib.import_module("tether.device.mcp.client.external"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _describe_error(exc: BaseException) -> str:
    from tether.device.mcp.client.session_util import describe_error  # an external server's error: `mcp` is loaded

    return describe_error(exc)


def _no_sandbox() -> Sandbox | None:
    return None


def create_server(config: MCPServerConfig, toolsets: Mapping[str, Callable[[], ToolSet]] | None = None,
                  sandbox: SandboxSource = _no_sandbox) -> BaseMCPServer:
    """The server object for one config entry; nothing is started yet."""
    toolsets = toolsets or {}
    if config.server_type not in ("stdio", "http", "sse") and config.toolset:
        return ToolSetServer(config, toolsets.get(config.toolset), known=toolsets)
    from tether.device.mcp.client import external as mcp_external  # the first external server needs the `mcp` SDK

    if config.server_type == "stdio":
        return mcp_external.StdioServer(config, sandbox)
    if config.server_type == "http":
        return mcp_external.HttpServer(config)
    if config.server_type == "sse":
        return mcp_external.SseServer(config)
    return mcp_external.ModuleServer(config)


class MCPServerManager:
    """Every MCP server of one device. Entries with the same `identity()` share one server (and one
    session); `reset=True` gives each `process_name` its own. `context` is the device's tool context:
    its `sandbox` confines the stdio servers configured with `sandbox: true`."""

    def __init__(self, toolsets: Mapping[str, Callable[[], ToolSet]] | None = None, *,
                 context: ToolContext | None = None, hooks: MCPClientHooks | None = None) -> None:
        self._toolsets: dict[str, Callable[[], ToolSet]] = dict(toolsets or {})
        self._servers: dict[tuple[str, str | None], BaseMCPServer] = {}
        self.context = context
        # who answers external servers' questions and sampling requests (`mcp.client_caps`)
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
            if not isinstance(server, ToolSetServer):  # an external server: its session's client side
                from tether.device.mcp.client.client_caps import ServerClientCaps
                from tether.device.mcp.client.servers import SessionServer

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
                name = str(item.get("namespace", "?")) if isinstance(item, dict) else item.namespace
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
                    f"server '{server.namespace}' failed to start: {_describe_error(exc)}")
            return None

        errors = await asyncio.gather(*(start(s) for s in unique.values()))
        failed = {s.namespace: e for s, e in zip(unique.values(), errors, strict=True) if e is not None}
        return invalid | failed

    async def roots_changed(self, context: ToolContext) -> None:
        """A new policy (and so new roots): servers with an open session are told `roots/list_changed`."""
        self.context = context
        external = [s for s in self._servers.values() if not isinstance(s, ToolSetServer)]
        if not external:
            return
        from tether.device.mcp.client.servers import SessionServer

        for server in external:
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
                logger.warning("closing server %s failed: %s", server.namespace, _describe_error(result))
