"""`Computer`: one execution context's tool registry over its MCP servers (seed 003), made from its parts in this
package (`registry`, `joining`, `running`) with what is its own: construction, start-up (`async_init`), servers
added and removed at run time, and the meta tools."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tether.device.computer.joining import ExternalJoins
from tether.device.computer.running import ActionRunner
from tether.device.mcp.client.resources import MCPResourceTools
from tether.device.mcp.client.toolset_server import ToolSetServer
from tether.protocol.models import ToolInfo, ToolType
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, ToolError
from tether.tools.runtime import ToolSpec, build_spec
from tether.tools.toolsets.builtin import sets_not_holding

if TYPE_CHECKING:
    from tether.device.computer.entries import ServerKey, ToolEntry
    from tether.device.mcp.client.manager import BaseMCPServer, MCPServerManager
    from tether.device.mcp.config.server_config import MCPServerConfig

logger = logging.getLogger(__package__)


class Computer(ExternalJoins, ActionRunner):
    """A named set of MCP servers and their tools; `async_init()` must be awaited before use."""

    on_tools_changed: Callable[[Computer], None] | None

    def __init__(self, name: str, process_name: str | None, mcp_server_manager: MCPServerManager,
                 data_collection_servers_config: Sequence[MCPServerConfig] = (),
                 action_servers_config: Sequence[MCPServerConfig] = (), *,
                 context: ToolContext | None = None, tool_timeout: float | None = None,
                 on_tools_changed: Callable[[Computer], None] | None = None, only_tool: str | None = None) -> None:
        """`only_tool`: the one tool this computer will be asked for (a one-off `tether exec`): the built-in
        sets that cannot hold it (`tether.tools.toolsets.builtin.sets_not_holding`) are not started or listed."""
        self._name = name
        self._process_name = process_name
        self._mcp_server_manager = mcp_server_manager
        configs: list[tuple[ToolType, MCPServerConfig]] = (
            [("data_collection", c) for c in data_collection_servers_config]
            + [("action", c) for c in action_servers_config]
        )
        # built-in sets first, then the config's own order: that order decides name collisions
        self._configs = sorted(configs, key=lambda item: item[1].toolset is None)
        self._servers: dict[ServerKey, BaseMCPServer] = {}
        self._order: list[ServerKey] = []  # registration order: the config's (built-ins first), then add_server's
        self._listed: dict[ServerKey, list[ToolInfo]] = {}  # each server's tools as it listed them
        self._joining: asyncio.Task[None] | None = None  # external servers starting after async_init
        self.still_starting: list[str] = []  # their namespaces, until each has joined or failed
        self._joined = asyncio.Event()  # set (and replaced) each time one of them has joined or failed
        self.on_tools_changed = on_tools_changed  # hears each external server joining (after async_init)
        self._tools_registry: dict[str, ToolEntry] = {}
        self._context = context or ToolContext()
        self._tool_timeout = tool_timeout
        self.collisions: list[dict[str, Any]] = []
        self.startup_errors: dict[str, str] = {}
        self._meta_tools = self._build_meta_tools()
        self._only_tool = only_tool

    @property
    def name(self) -> str:
        """The name it was created with."""
        return self._name

    @property
    def context(self) -> ToolContext:
        """The device's tool context: a call given none runs in a copy of it made for that call (`run_action`)."""
        return self._context

    def _build_meta_tools(self) -> dict[str, ToolSpec]:
        spec = build_spec(self.list_tools, "list_tools", "data_collection", None,
                          "List the tools this device offers, optionally filtered by type or namespace.")
        undo = build_spec(self.undo_session, "undo_session", "action", None,
                          "Put back the files a session's commands changed (its undo journal), newest first. "
                          "Needs an approval: it rewrites files.")
        end = build_spec(self.end_session, "end_session", "action", None,
                         "End the batch's own session on this device: what the device keeps for it alone (its "
                         "private /tmp) is removed now. Its undo journal stays.")
        resources = MCPResourceTools(self._external_servers, self.wait_for_joins)
        return {"list_tools": spec, "undo_session": undo, "end_session": end, **resources.specs()}

    def _external_servers(self) -> list[BaseMCPServer]:
        """The servers with an MCP session of their own (resources and prompts), not the built-in sets."""
        return list(dict.fromkeys(s for s in self._servers.values() if not isinstance(s, ToolSetServer)))

    async def undo_session(self, ctx: ToolContext, session_id: str) -> list[dict[str, Any]]:
        """How a server undoes a task on this device (the task id is the session id of its commands).

        It is a meta tool, so planners never see it, and it needs an approval so that a plan that
        names it anyway cannot rewrite files behind the person's back."""
        if ctx.journal is None:
            raise ToolError("this device keeps no undo journal")
        if not ctx.approved_by:
            raise NeedsApproval("undo", f"undoing session {session_id} rewrites the files it changed")
        try:
            return await asyncio.to_thread(ctx.journal.restore, session_id, ctx.policy.write_roots)
        except ValueError as exc:
            raise ToolError(str(exc)) from None

    async def end_session(self, ctx: ToolContext) -> dict[str, Any]:
        """How a server tells this device that a session has ended (a task finished, a one-off `tether exec`
        call returned): the session's private /tmp (`tether.sandbox.private_tmp`) is removed now rather
        than after a day idle. Only the batch's own session (`ctx.session_id`): a caller ends no session it
        could not send commands into. Batches of one session run in order, so none of its commands is
        still running. Result: `{"session_id", "tmp_removed"}`; ToolError for a batch without a session."""
        if not ctx.session_id:
            raise ToolError("end_session: the batch names no session")
        removed = ctx.sandbox is not None and await ctx.sandbox.end_session(ctx.session_id)
        logger.info("session %s ended%s", ctx.session_id, ": its private /tmp removed" if removed else "")
        return {"session_id": ctx.session_id, "tmp_removed": removed}

    async def list_tools(self, tool_type: ToolType | None = None, namespace: str | None = None,
                         remove_meta: bool = True) -> list[dict[str, Any]]:
        """The meta tool `list_tools`: `tool_infos` as plain dicts."""
        return [info.model_dump() for info in self.tool_infos(tool_type, namespace, remove_meta)]

    async def async_init(self, *, join_external: bool = False, join_after: asyncio.Event | None = None) -> None:
        """Open every configured server in parallel, then register tools in config order. With
        `join_external`, only the built-in tool sets are waited for; the external servers are started
        in the background (once `join_after` is set, e.g. when the device has registered: importing the
        SDK competes for the interpreter) and join one by one (`still_starting`, `wait_for_joins`,
        `on_tools_changed`). With `only_tool`, the built-in sets that cannot hold it are made (their config's
        rules still answer for their names) but neither started nor listed (`sets_not_holding`)."""
        self._order = [(tool_type, cfg.namespace) for tool_type, cfg in self._configs]
        idle = sets_not_holding(self._only_tool, [((t, c.namespace), c.toolset, c.namespace) for t, c in self._configs])
        later: dict[ServerKey, MCPServerConfig] = {}
        for tool_type, cfg in self._configs:
            if join_external and cfg.toolset is None:  # created in the background: they import `mcp`
                later[(tool_type, cfg.namespace)] = cfg
                continue
            server = self._mcp_server_manager.create_or_get_server(cfg, reset=cfg.reset,
                                                                   process_name=self._process_name)
            self._servers[(tool_type, cfg.namespace)] = server
        errors = await self._mcp_server_manager.start_servers(
            list(dict.fromkeys(s for key, s in self._servers.items() if key not in idle)))
        self.startup_errors = {ns: err for ns, err in (errors or {}).items()}
        for key, server in self._servers.items():
            if key not in idle:
                await self._list(key, server)
        self._rebuild()
        if later:
            self.still_starting = list(dict.fromkeys(ns for _, ns in later))
            self._joining = asyncio.create_task(self._join_external(later, join_after), name=f"join {self._name}")

    async def add_server(self, namespace: str, mcp_server: BaseMCPServer, tool_type: ToolType) -> None:
        """Attach a server at run time; it is started if needed and its tools registered."""
        errors = await self._mcp_server_manager.start_servers([mcp_server])
        if errors:
            raise RuntimeError(f"server '{namespace}' did not start: {errors.get(namespace, errors)}")
        key = (tool_type, namespace)
        self._servers[key] = mcp_server
        if key not in self._order:
            self._order.append(key)
        await self._list(key, mcp_server)
        self._rebuild()

    async def delete_server(self, namespace: str, tool_type: ToolType) -> None:
        """Detach a server and its tools; a plain name it shadowed falls back to the next holder."""
        key = (tool_type, namespace)
        server = self._servers.pop(key, None)
        if server is None:
            raise ValueError(f"no {tool_type} server '{namespace}' on computer '{self._name}'")
        self._listed.pop(key, None)
        self._order = [k for k in self._order if k != key]
        self._rebuild()
