"""`ToolSetServer`: a built-in tool set behind the `BaseMCPServer` interface, called directly.

Built-in tools (shell, files, system, ...) are what a device runs most, and every command to them is
on the round-trip's hot path. They need none of what an external server needs (a session, a
supervisor task, restarts with backoff): the call goes straight to `ToolSet.call`, and a reset
just builds the tool set again. Keeping this small adapter apart from `mcp.servers`' session
machinery keeps that path short and plain to read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from tether.device.mcp.client.base import BaseMCPServer, MCPServerError
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.protocol.models import Result, ToolInfo, ToolType
from tether.tools.context import ToolContext
from tether.tools.errors import MissingDependency
from tether.tools.runtime import ToolSet, ToolSpec

logger = logging.getLogger(__name__)


class ToolSetServer(BaseMCPServer):
    """A built-in `ToolSet`, called directly: validation and timeout live in `ToolSet.call`."""

    def __init__(self, config: MCPServerConfig, factory: Callable[[], ToolSet] | None,
                 known: Iterable[str] = ()) -> None:
        super().__init__(config)
        self._factory = factory
        self._known = sorted(known)
        self._toolset: ToolSet | None = None
        self._closed = False

    @property
    def healthy(self) -> bool:
        return self._toolset is not None and not self._closed

    def describe(self) -> str:
        return f"built-in tool set '{self.config.toolset}'"

    async def start(self) -> None:
        if self._closed:
            raise MCPServerError(f"server '{self.namespace}' is closed")
        if self._factory is None:
            known = ", ".join(self._known) or "none"
            raise MCPServerError(f"server '{self.namespace}': unknown built-in tool set "
                                 f"'{self.config.toolset}' (known: {known})")
        try:
            toolset = self._factory()
        except MissingDependency as exc:
            raise MCPServerError(f"'{self.namespace}' tools are unavailable here: {exc}") from exc
        except Exception as exc:
            raise MCPServerError(f"server '{self.namespace}' ({self.describe()}) failed to start: "
                                 f"{type(exc).__name__}: {exc}") from exc
        if toolset.namespace != self.namespace:  # the config's namespace is what planners see
            toolset = ToolSet(self.namespace, [s.fn for s in toolset.specs.values()], toolset.description,
                              on_close=toolset.on_close)
        old, self._toolset, self._reset_pending = self._toolset, toolset, False
        if old is not None:  # a reset: release what the previous instance held (e.g. its browser)
            self.restarts += 1
            await old.aclose()

    async def list_tools(self, tool_type: ToolType) -> list[ToolInfo]:
        if self._toolset is None:
            await self.start()
        assert self._toolset is not None
        return self._toolset.infos()

    def direct(self, name: str, timeout: float | None) -> tuple[ToolSpec, float | None] | None:
        """The tool's spec and the timeout `call_tool` would give it, for a caller that runs it with
        `call_spec` itself (the `Computer`, on the hot path): None when `call_tool` must do the call
        (the tool set is not built, a reset is due, the server is closed, the tool is unknown).
        Such a caller turns an exception out of `call_spec` into `internal_failure`, as `call_tool` does."""
        toolset = self._toolset
        if toolset is None or self._reset_pending:
            return None
        spec = toolset.specs.get(name)
        if spec is None:
            return None
        if timeout is None and spec.timeout is None:  # a tool's own timeout is more specific
            timeout = self.config.timeout
        return spec, timeout

    def internal_failure(self, name: str, exc: Exception, ctx: ToolContext) -> Result:
        """An exception out of `ToolSet.call`/`call_spec` (they catch tool errors): logged, as a failure."""
        logger.exception("tool set %s failed on %s", self.namespace, name)
        return self._failure(f"server '{self.namespace}' tool '{name}': internal error: {exc}", ctx)

    async def call_tool(self, name: str, arguments: dict[str, Any] | None, *, ctx: ToolContext,
                        timeout: float | None) -> Result:
        toolset = self._toolset
        if toolset is None or self._reset_pending:
            try:
                await self.start()
            except MCPServerError as exc:
                return self._failure(str(exc), ctx)
            toolset = self._toolset
            assert toolset is not None
        if timeout is None and self.config.timeout is not None:  # a tool's own timeout is more specific
            spec = toolset.specs.get(name)
            if spec is not None and spec.timeout is None:
                timeout = self.config.timeout
        try:
            return await toolset.call(name, arguments, ctx, timeout)
        except Exception as exc:  # ToolSet.call catches tool errors; this guards the contract
            return self.internal_failure(name, exc, ctx)

    async def close(self) -> None:
        self._closed = True
        toolset, self._toolset = self._toolset, None
        if toolset is not None:
            await toolset.aclose()
