"""External MCP servers joining a computer after it has started: each is started in the background, joins the
registry when ready (`on_tools_changed` hears of it), and a command naming a tool not there yet waits for those
still starting, within its own deadline (`command2tool_when_joined`, at most `JOIN_WAIT_S`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tether.device.computer.entries import MCPToolCall, ServerKey
from tether.device.computer.registry import ToolRegistry
from tether.protocol.models import Command

if TYPE_CHECKING:
    from tether.device.mcp.client.manager import BaseMCPServer, MCPServerManager
    from tether.device.mcp.config.server_config import MCPServerConfig

logger = logging.getLogger(__package__)

JOIN_WAIT_S = 60.0  # longest a command without a deadline waits for external servers still starting


class ExternalJoins(ToolRegistry):
    """The joining part of `tether.device.computer.Computer`, which sets every attribute below in its constructor
    and starts the joining task (`_joining`) from `async_init`."""

    _process_name: str | None
    _mcp_server_manager: MCPServerManager
    _joining: asyncio.Task[None] | None
    still_starting: list[str]
    _joined: asyncio.Event
    on_tools_changed: Callable[[Any], None] | None  # called with the computer (`Computer` narrows it)

    async def _join_external(self, configs: dict[ServerKey, MCPServerConfig], after: asyncio.Event | None) -> None:
        if after is not None:
            await after.wait()
        try:
            # the SDK's import (heavy) in a thread: the device serves meanwhile
            await asyncio.to_thread(importlib.import_module, "tether.device.mcp.client.external")
            by_server: dict[BaseMCPServer, list[ServerKey]] = {}
            for key, cfg in configs.items():
                server = self._mcp_server_manager.create_or_get_server(cfg, reset=cfg.reset,
                                                                       process_name=self._process_name)
                self._servers[key] = server
                by_server.setdefault(server, []).append(key)
        except Exception as exc:  # e.g. the SDK cannot be imported: those servers fail, the device serves on
            logger.exception("computer %s: external MCP servers cannot start", self._name)
            for namespace in self.still_starting:
                self.startup_errors[namespace] = f"server '{namespace}' failed to start: {exc}"
            self.still_starting = []
            self._signal_joined()
            return
        await asyncio.gather(*(self._join(server, keys) for server, keys in by_server.items()))

    async def _join(self, server: BaseMCPServer, keys: list[ServerKey]) -> None:
        errors = await self._mcp_server_manager.start_servers([server])
        self.startup_errors.update(errors)
        for key in keys:
            if self._servers.get(key) is server:  # not deleted meanwhile
                await self._list(key, server)
        self.still_starting = [ns for ns in self.still_starting if ns != server.namespace]
        self._rebuild()
        self._signal_joined()
        if server.namespace not in self.startup_errors:
            logger.info("computer %s: server %s joined with %d tool(s)", self._name, server.namespace,
                        sum(len(self._listed.get(key, ())) for key in keys))
        if any(self._listed.get(key) for key in keys) and self.on_tools_changed is not None:
            try:
                self.on_tools_changed(self)
            except Exception:
                logger.exception("computer %s: on_tools_changed failed", self._name)

    async def wait_for_joins(self, deadline: float | None = None) -> bool:
        """Wait for the external servers still starting, until the loop time `deadline` at most (at most
        `JOIN_WAIT_S` without one); True when none is left starting."""
        joining = self._joining
        if joining is None or joining.done():
            return True
        loop = asyncio.get_running_loop()
        end = min(deadline, loop.time() + JOIN_WAIT_S) if deadline is not None else loop.time() + JOIN_WAIT_S
        await asyncio.wait([joining], timeout=max(0.0, end - loop.time()))
        return joining.done()

    def _signal_joined(self) -> None:
        joined, self._joined = self._joined, asyncio.Event()
        joined.set()

    async def command2tool_when_joined(self, command: Command, deadline: float | None = None) -> MCPToolCall:
        """`command2tool` for a command it refused while external servers are still starting: resolved
        again each time one joins, until it resolves, none is left starting or the deadline (at most
        `JOIN_WAIT_S` away) has passed; the error then names those still starting."""
        loop = asyncio.get_running_loop()
        end = loop.time() + JOIN_WAIT_S if deadline is None else min(deadline, loop.time() + JOIN_WAIT_S)
        while self.still_starting:
            with contextlib.suppress(ValueError):
                return self.command2tool(command)
            try:
                async with asyncio.timeout_at(end):
                    await self._joined.wait()
            except TimeoutError:
                break
        try:
            return self.command2tool(command)
        except ValueError as exc:
            if self.still_starting:
                raise ValueError(f"{exc} (MCP servers still starting: {', '.join(self.still_starting)})") from None
            raise

    async def aclose(self) -> None:
        """Stop joining external servers (the manager closes the servers themselves)."""
        joining, self._joining = self._joining, None
        if joining is not None and not joining.done():
            joining.cancel()
            await asyncio.gather(joining, return_exceptions=True)
        self.still_starting = []
        self._signal_joined()  # a command still waiting for one resolves (or fails) now
