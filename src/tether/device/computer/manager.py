"""`ComputerManager`: one `Computer` per `agent::process::root`, created on first use (seed 003)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tether.device.computer import Computer
from tether.device.config import DEFAULT_AGENT, DeviceConfig
from tether.device.mcp.client.manager import MCPServerManager
from tether.tools.context import ToolContext

logger = logging.getLogger(__name__)


class ComputerManager:
    """Caches computers by key; a root that is not configured falls back to the agent's `default`."""

    def __init__(self, configs: DeviceConfig, mcp_server_manager: MCPServerManager, *,
                 context: ToolContext | None = None, tool_timeout: float | None = None,
                 join_external: bool = False, join_after: asyncio.Event | None = None,
                 on_tools_changed: Callable[[Computer], None] | None = None, only_tool: str | None = None) -> None:
        """`join_external`: computers are ready with their built-in tools and external MCP servers join
        later, once `join_after` is set (None: at once); `on_tools_changed(computer)` hears of each
        joining (a device serving a server then sends its new profile). `only_tool`: the one tool a
        device that runs one command is asked for (`Computer`: the built-in sets that cannot hold it stay
        unstarted)."""
        self.configs = configs
        self.mcp_server_manager = mcp_server_manager
        self.context = context or ToolContext()
        self.tool_timeout = tool_timeout
        # a device serving a server: computers are ready with their built-in tools, external servers join
        # later (`Computer.async_init`), and `on_tools_changed` hears of each (the device sends its profile)
        self.join_external = join_external
        self.join_after = join_after  # set: external servers may start (see Computer)
        self.on_tools_changed = on_tools_changed
        self.only_tool = only_tool
        self.computers: dict[str, Computer] = {}
        self._creating: dict[str, asyncio.Future[Computer]] = {}

    @staticmethod
    def key(agent_name: str, process_name: str | None, root_name: str) -> str:
        return f"{agent_name}::{process_name or ''}::{root_name}"

    def get_existing(self, agent_name: str | None, process_name: str | None = None,
                     root_name: str | None = None) -> Computer | None:
        """The computer `get_or_create` would return at once, without awaiting it; None when it
        does not exist yet (or the agent is unknown: `get_or_create` says why)."""
        agent = agent_name or DEFAULT_AGENT
        try:
            resolved_root, _ = self.configs.root(agent, root_name)
        except ValueError:
            return None
        return self.computers.get(self.key(agent, process_name, resolved_root))

    async def get_or_create(self, agent_name: str | None, process_name: str | None = None,
                            root_name: str | None = None) -> Computer:
        """The computer for this context; ValueError for an agent the config does not know."""
        agent = agent_name or DEFAULT_AGENT
        resolved_root, root = self.configs.root(agent, root_name)
        key = self.key(agent, process_name, resolved_root)
        computer = self.computers.get(key)
        if computer is not None:
            return computer
        pending = self._creating.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[Computer] = asyncio.get_running_loop().create_future()
        self._creating[key] = future
        try:
            computer = Computer(key, process_name, self.mcp_server_manager, root.data_collection, root.action,
                                context=self.context, tool_timeout=self.tool_timeout,
                                on_tools_changed=self._tools_changed, only_tool=self.only_tool)
            await computer.async_init(join_external=self.join_external, join_after=self.join_after)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            self._creating.pop(key, None)
        self.computers[key] = computer
        future.set_result(computer)
        return computer

    def _tools_changed(self, computer: Computer) -> None:
        if self.on_tools_changed is not None and self.computers.get(computer.name) is computer:
            self.on_tools_changed(computer)

    def reset(self) -> None:
        """Forget computers so the next task rebuilds its registry (servers themselves stay up)."""
        self.computers.clear()

    async def aclose(self) -> None:
        """Stop the computers' external servers from joining (before the servers are closed)."""
        computers, self.computers = list(self.computers.values()), {}
        await asyncio.gather(*(c.aclose() for c in computers))
