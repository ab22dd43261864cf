"""What every tool server of a device is, however it is reached: `BaseMCPServer` and its error.

Apart from `mcp.servers` (the external servers' session machinery) so that a device whose tools are
all built in never imports the `mcp` SDK: `mcp.toolset_server` and the manager need only this
(importing `mcp` is a large part of a `tether device` or `tether exec` start).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tether.device.mcp.config.server_config import MCPServerConfig
from tether.device.mcp.config.tool_rules import MCPToolPolicy
from tether.errors import DeviceError
from tether.protocol.models import Result, ToolInfo, ToolType
from tether.tools.context import ToolContext
from tether.tools.errors import ToolError

T = TypeVar("T")


class MCPServerError(DeviceError, RuntimeError):
    """A server could not be started or listed; the message names the server and the reason."""


class BaseMCPServer(ABC):
    """One namespace of tools on a device, however it is reached."""

    def __init__(self, config: MCPServerConfig) -> None:
        self.config = config
        self.namespace = config.namespace
        self.restarts = 0
        self._reset_pending = False
        self.tool_policy = MCPToolPolicy.from_config(config)

    @property
    @abstractmethod
    def healthy(self) -> bool: ...

    @abstractmethod
    async def start(self) -> None:
        """Make the server usable; raises `MCPServerError` with a clear reason when it cannot be."""

    @abstractmethod
    async def list_tools(self, tool_type: ToolType) -> list[ToolInfo]: ...

    @abstractmethod
    async def call_tool(self, name: str, arguments: dict[str, Any] | None, *, ctx: ToolContext,
                        timeout: float | None) -> Result: ...

    @abstractmethod
    async def close(self) -> None: ...

    def request_reset(self) -> None:
        """Restart before the next call (a device reset); cheap and synchronous."""
        self._reset_pending = True

    async def health_check(self, timeout: float = 5.0) -> bool:
        return self.healthy

    def describe(self) -> str:
        return self.config.server_type

    async def session_request(self, what: str, request: Callable[[Any], Awaitable[T]], timeout: float) -> T:
        """A request other than a tool call (resources, prompts: `mcp.resources`) on this server's MCP
        session; `ToolError` naming the server when it cannot be made. Only external servers have one."""
        raise ToolError(f"server '{self.namespace}' is a built-in tool set: it has no MCP resources or prompts")

    def refusal(self, name: str) -> str | None:
        """Why a tool this server keeps unlisted may not be called (for "unknown tool" errors), or None."""
        denied = self.tool_policy.refusal(name)
        return None if denied is None else str(denied)

    def _failure(self, error: str, ctx: ToolContext, result: Any = None) -> Result:
        return Result.failure(error, call_id=ctx.call_id, namespace=self.namespace, result=result)
