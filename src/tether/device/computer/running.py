"""Running resolved tool calls on a computer: a meta tool, a built-in tool set's tool called directly, or an MCP
server's `call_tool`; every failure comes back as a failed `Result` for that call."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from tether.device.computer.entries import META_NAMESPACE, MCPToolCall
from tether.device.computer.registry import ToolRegistry
from tether.protocol.models import Result
from tether.tools.context import ToolContext
from tether.tools.runtime import call_spec

logger = logging.getLogger(__package__)


class ActionRunner(ToolRegistry):
    """The running part of `tether.device.computer.Computer`, which sets `_context` (the context a call gets
    without one of its own) and `_tool_timeout` (a call's timeout when its command sets none)."""

    _context: ToolContext
    _tool_timeout: float | None

    async def run_actions(self, tool_calls: Sequence[MCPToolCall], context: ToolContext | None = None) -> list[Result]:
        """`run_action` for each call in turn: one result per call, in order."""
        return [await self.run_action(call, context) for call in tool_calls]

    async def run_action(self, call: MCPToolCall, context: ToolContext | None = None) -> Result:
        """Run one resolved call (a meta tool, a built-in set's tool directly, or its server's `call_tool`) under
        its timeout, else the computer's, in `context` or else a copy of the computer's made for the call. A tool
        that is not registered or a server that raises gives a failed `Result` with the call's `call_id`;
        only cancellation is raised."""
        entry = self._tools_registry.get(call.tool_key)
        if entry is None:
            return Result.failure(f"tool '{call.tool_key}' is not registered", call.call_id)
        ctx = context if context is not None else self._context.for_call(
            session_id=self._context.session_id, call_id=call.call_id, approved_by=call.approved_by)
        timeout = call.timeout or self._tool_timeout
        if entry.meta is not None:
            return await call_spec(entry.meta, META_NAMESPACE, call.parameters, ctx, timeout)
        direct = entry.direct
        if direct is not None:
            # a built-in tool set: its tool straight through `call_spec`, as `ToolSetServer.call_tool` does
            # minus two nested calls on the hot path; a due start or reset still goes through `call_tool`
            prepared = direct.direct(entry.info.name, timeout)
            if prepared is not None:
                try:
                    result = await call_spec(prepared[0], direct.namespace, call.parameters, ctx, prepared[1])
                except Exception as exc:  # call_spec catches tool errors; as call_tool guards the contract
                    result = direct.internal_failure(entry.info.name, exc, ctx)
                if result.call_id != call.call_id:
                    result = result.model_copy(update={"call_id": call.call_id})
                return result
        assert entry.server is not None
        try:
            result = await entry.server.call_tool(entry.info.name, call.parameters, ctx=ctx, timeout=timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a server must not raise, but one bug must not break the batch
            logger.exception("server %s raised from call_tool", entry.info.namespace)
            return Result.failure(f"{entry.info.name}: server '{entry.info.namespace}' failed: {exc}",
                                  call.call_id, entry.info.namespace)
        if result.call_id != call.call_id:
            result = result.model_copy(update={"call_id": call.call_id})
        return result
