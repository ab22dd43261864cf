"""`Computer`: one execution context's tool registry over its MCP servers (seed 003).

Tools are keyed `tool_type::tool_name`. When two servers of one tool type offer the same name,
the one registered first (built-in tool sets, then the config's order) keeps the plain name and
the rest stay reachable by their qualified name `namespace/tool_name`; every such collision is
recorded in `collisions` and logged, so the resolution is deterministic and visible rather than
whichever server answered first.

A device serving a server registers as soon as its built-in tools are ready: with `join_external`,
each external MCP server joins the registry when it has started (the registry is rebuilt in config
order, so collisions resolve the same whatever the order servers become ready in), `on_tools_changed`
tells the device to send its new profile, and a command naming a tool that is not there yet waits
for the servers still starting, within its own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from tether.device.mcp.client.resources import MCPResourceTools
from tether.device.mcp.client.toolset_server import ToolSetServer
from tether.protocol.models import TOOL_TYPES, Command, Result, ToolInfo, ToolType
from tether.tools.builtin import OPTIONAL_SETS, OPTIONAL_TOOLS, sets_not_holding
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, ToolError
from tether.tools.runtime import ToolSpec, build_spec, call_spec

if TYPE_CHECKING:
    from tether.device.mcp.client.manager import BaseMCPServer, MCPServerManager
    from tether.device.mcp.config.server_config import MCPServerConfig

logger = logging.getLogger(__name__)

META_NAMESPACE = "meta"
JOIN_WAIT_S = 60.0  # longest a command without a deadline waits for external servers still starting

ServerKey = tuple[ToolType, str]


@dataclass(frozen=True)
class ToolEntry:
    """A registered tool: one a server listed (`listed`, run by `server`), or one of the computer's meta tools
    (`meta`, as a `meta_type` tool), whose `info` — with the schema built from its signature — is made when
    first read: a device registers without listing them (`tool_infos`)."""

    listed: ToolInfo | None = None
    server: BaseMCPServer | None = None
    meta: ToolSpec | None = None
    direct: ToolSetServer | None = None  # `server`, when it is a built-in tool set `run_action` calls directly
    meta_type: ToolType = "data_collection"

    @cached_property
    def info(self) -> ToolInfo:
        """The tool as `list_tools` shows it."""
        if self.listed is not None:
            return self.listed
        assert self.meta is not None
        return ToolInfo(name=self.meta.name, namespace=META_NAMESPACE, tool_type=self.meta_type,
                        description=self.meta.description, input_schema=self.meta.input_schema, meta=True)


@dataclass(frozen=True, slots=True)
class MCPToolCall:
    """A command resolved to one registered tool: what `run_actions` executes."""

    tool_key: str
    tool_name: str
    parameters: dict[str, Any] | None = None
    call_id: str | None = None
    timeout: float | None = None
    approved_by: str | None = None


class Computer:
    """A named set of MCP servers and their tools; `async_init()` must be awaited before use."""

    def __init__(self, name: str, process_name: str | None, mcp_server_manager: MCPServerManager,
                 data_collection_servers_config: Sequence[MCPServerConfig] = (),
                 action_servers_config: Sequence[MCPServerConfig] = (), *,
                 context: ToolContext | None = None, tool_timeout: float | None = None,
                 on_tools_changed: Callable[[Computer], None] | None = None, only_tool: str | None = None) -> None:
        """`only_tool`: the one tool this computer will be asked for (a one-off `tether exec`): the built-in
        sets that cannot hold it (`tether.tools.builtin.sets_not_holding`) are not started or listed."""
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
        return self._name

    @property
    def context(self) -> ToolContext:
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
        return [info.model_dump() for info in self.tool_infos(tool_type, namespace, remove_meta)]

    def tool_infos(self, tool_type: ToolType | None = None, namespace: str | None = None,
                   remove_meta: bool = True) -> list[ToolInfo]:
        seen: set[tuple[str, str, str]] = set()
        out: list[ToolInfo] = []
        for entry in self._tools_registry.values():
            if remove_meta and entry.meta is not None:  # not even its info made (nor its schema)
                continue
            info = entry.info
            if (tool_type and info.tool_type != tool_type) or (namespace and info.namespace != namespace):
                continue
            if remove_meta and info.meta:
                continue
            ident = (info.tool_type, info.namespace, info.name)
            if ident not in seen:
                seen.add(ident)
                out.append(info)
        return out

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

    async def _list(self, key: ServerKey, server: BaseMCPServer) -> None:
        tool_type, namespace = key
        if namespace in self.startup_errors:
            level = logging.INFO if namespace in OPTIONAL_SETS else logging.WARNING
            logger.log(level, "computer %s: server %s did not start: %s", self._name, namespace,
                       self.startup_errors[namespace])
            return
        try:
            self._listed[key] = await server.list_tools(tool_type)
        except Exception as exc:
            self.startup_errors[namespace] = f"list_tools failed: {exc}"
            logger.warning("computer %s: cannot list tools of %s: %s", self._name, namespace, exc)

    def _rebuild(self) -> None:
        """The registry from every listed server in registration order, swapped in whole (a reader never
        sees half of it); then the meta tools, which keep their names."""
        registry: dict[str, ToolEntry] = {}
        collisions: list[dict[str, Any]] = []
        for key in self._order:
            server = self._servers.get(key)
            for info in self._listed.get(key, ()) if server is not None else ():
                entry = ToolEntry(listed=info, server=server,
                                  direct=server if isinstance(server, ToolSetServer) else None)
                registry[f"{info.tool_type}::{info.namespace}/{info.name}"] = entry
                holder = registry.get(info.key)
                if holder is None:
                    registry[info.key] = entry
                    continue
                collisions.append({"tool": info.name, "tool_type": info.tool_type, "kept": holder.info.namespace,
                                   "shadowed": info.namespace, "use": f"{info.namespace}/{info.name}"})
        for collision in collisions:
            if collision not in self.collisions:
                logger.info("tool name collision: %(tool)s (%(tool_type)s) kept from %(kept)s; "
                            "%(shadowed)s's is reachable as %(use)s", collision)
        for tool_type in TOOL_TYPES:
            for spec in self._meta_tools.values():
                registry[f"{tool_type}::{spec.name}"] = ToolEntry(meta=spec, meta_type=tool_type)  # its info.key
        self._tools_registry, self.collisions = registry, collisions

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

    def _lookup(self, name: str, tool_type: ToolType | None) -> tuple[str, ToolEntry] | str:
        if tool_type is not None:
            key = f"{tool_type}::{name}"
            entry = self._tools_registry.get(key)
            if entry is None:
                other = "action" if tool_type == "data_collection" else "data_collection"
                hint = (f"; it exists as a {other} tool"
                        if f"{other}::{name}" in self._tools_registry else "")
                return self._unavailable(name) or (
                    f"unknown tool '{name}' ({tool_type}){hint}; call list_tools to see what exists")
            return key, entry
        found: tuple[str, ToolEntry] | None = None
        for t in TOOL_TYPES:  # the first type that has it; a second one is ambiguous unless the first is meta
            key = f"{t}::{name}"
            entry = self._tools_registry.get(key)
            if entry is None:
                continue
            if found is None:
                found = key, entry
            elif not found[1].info.meta:
                return f"tool '{name}' exists as both data_collection and action: set tool_type"
        if found is None:
            return self._unavailable(name) or f"unknown tool '{name}'; call list_tools to see what exists"
        return found

    def _unavailable(self, name: str) -> str | None:
        """For a tool of an optional set that could not start here: why, and what to install; for a tool
        the device config keeps from agents (an external server's deny_tools/allow_tools): the rule."""
        for namespace, names in OPTIONAL_TOOLS.items():
            if name in names and namespace in self.startup_errors:
                return f"tool '{name}' is not available on this device: {self.startup_errors[namespace]}"
        namespace, _, plain = name.rpartition("/")
        for (_, server_namespace), server in self._servers.items():
            if not namespace or namespace == server_namespace:
                why = server.refusal(plain)
                if why is not None:
                    return why
        return None

    def command2tool(self, command: Command) -> MCPToolCall:
        """Resolve a command to a registered tool; ValueError (with a hint) when it cannot be."""
        found = self._lookup(command.tool_name, command.tool_type)
        if isinstance(found, str):
            raise ValueError(found)
        key, entry = found
        return MCPToolCall(tool_key=key, tool_name=entry.info.name, parameters=command.parameters,
                           call_id=command.call_id, timeout=command.timeout, approved_by=command.approved_by)

    async def run_actions(self, tool_calls: Sequence[MCPToolCall], context: ToolContext | None = None) -> list[Result]:
        return [await self.run_action(call, context) for call in tool_calls]

    async def run_action(self, call: MCPToolCall, context: ToolContext | None = None) -> Result:
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
