"""`DeviceClient`: executes what the server sends, nothing more (seed 001).

It keeps only session metadata (validated on assignment), runs one batch at a time under
`task_lock` when used directly (local mode), and delegates every command to the `CommandRouter`.
It never plans or interprets. A device serving a server runs batches through `BatchRunner`, which
keeps that order per session and passes each batch's context to the router itself, so sessions
can run side by side.
"""

from __future__ import annotations

import asyncio
import logging
import platform as _platform
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tether.device.computer.manager import ComputerManager
from tether.device.computer.router import CommandRouter
from tether.device.mcp.client.manager import MCPServerManager
from tether.protocol.models import Command, Result
from tether.tools.context import EventSink

if TYPE_CHECKING:
    from tether.protocol.messages import ServerMessage  # the frames: only a device on a link needs them

logger = logging.getLogger(__name__)


def _checked(label: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{label} must be a string or None.")
    return value


class DeviceClient:
    def __init__(self, mcp_server_manager: MCPServerManager, computer_manager: ComputerManager,
                 client_id: str = "client_001", platform: str | None = None) -> None:
        self.mcp_server_manager = mcp_server_manager
        self.computer_manager = computer_manager
        self.command_router = CommandRouter(computer_manager)
        self.task_lock = asyncio.Lock()
        self.client_id = client_id
        self.platform = platform or _platform.system().lower()
        self._session_id: str | None = None
        self._agent_name: str | None = None
        self._process_name: str | None = None
        self._root_name: str | None = None

    @property
    def session_id(self) -> str | None:
        return self._session_id

    @session_id.setter
    def session_id(self, value: str | None) -> None:
        self._session_id = _checked("Session ID", value)

    @property
    def agent_name(self) -> str | None:
        return self._agent_name

    @agent_name.setter
    def agent_name(self, value: str | None) -> None:
        self._agent_name = _checked("Agent name", value)

    @property
    def process_name(self) -> str | None:
        return self._process_name

    @process_name.setter
    def process_name(self, value: str | None) -> None:
        self._process_name = _checked("Process name", value)

    @property
    def root_name(self) -> str | None:
        return self._root_name

    @root_name.setter
    def root_name(self, value: str | None) -> None:
        self._root_name = _checked("Root name", value)

    async def execute_step(self, response: ServerMessage, emit: EventSink | None = None) -> list[Result]:
        """Adopt the message's context, then run its actions."""
        if response.session_id is not None:
            self.session_id = response.session_id
        self.agent_name = response.agent_name
        self.process_name = response.process_name
        self.root_name = response.root_name
        return await self.execute_actions(response.actions, early_exit=response.early_exit, emit=emit)

    async def execute_actions(self, commands: Sequence[Command] | None, *, early_exit: bool = True,
                              emit: EventSink | None = None,
                              on_result: Callable[[Result], None] | None = None,
                              deadline: float | None = None) -> list[Result]:
        if not commands:
            return []
        logger.info("executing %d action(s) for agent %s", len(commands), self._agent_name)
        return await self.command_router.execute(self._agent_name, self._process_name, self._root_name,
                                                 commands, early_exit, session_id=self._session_id, emit=emit,
                                                 on_result=on_result, deadline=deadline)

    def reset(self) -> None:
        """Clear session state and cascade to the managers before the next task."""
        self._session_id = None
        self._agent_name = None
        self._process_name = None
        self._root_name = None
        self.computer_manager.reset()
        self.mcp_server_manager.reset()
        logger.info("client state has been reset")
