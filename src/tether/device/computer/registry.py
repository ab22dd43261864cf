"""The computer's tool registry: each server's listing (`_list`), the registry built from every listing in
registration order with its name collisions (`_rebuild`), and a command resolved against it (`command2tool`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tether.device.computer.entries import MCPToolCall, ServerKey, ToolEntry
from tether.device.mcp.client.toolset_server import ToolSetServer
from tether.protocol.models import TOOL_TYPES, Command, ToolInfo, ToolType
from tether.tools.toolsets.builtin import OPTIONAL_SETS, OPTIONAL_TOOLS

if TYPE_CHECKING:
    from tether.device.mcp.client.manager import BaseMCPServer
    from tether.tools.runtime import ToolSpec

logger = logging.getLogger(__package__)


class ToolRegistry:
    """The registry part of `tether.device.computer.Computer`, which sets every attribute below in its
    constructor: tools keyed `tool_type::tool_name`, the first holder of a plain name keeping it and the others
    reachable as `namespace/tool_name` (each such case in `collisions`)."""

    _name: str
    _servers: dict[ServerKey, BaseMCPServer]
    _order: list[ServerKey]
    _listed: dict[ServerKey, list[ToolInfo]]
    _tools_registry: dict[str, ToolEntry]
    _meta_tools: dict[str, ToolSpec]
    collisions: list[dict[str, Any]]
    startup_errors: dict[str, str]

    def tool_infos(self, tool_type: ToolType | None = None, namespace: str | None = None,
                   remove_meta: bool = True) -> list[ToolInfo]:
        """The registered tools in registration order, each (type, namespace, name) once: of `tool_type` and of
        `namespace` when given; without the meta tools while `remove_meta` (their infos are then never made)."""
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
