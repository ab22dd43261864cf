"""What the computer's registry holds: `ToolEntry` (one registered tool, listed by a server or one of the meta
tools) and `MCPToolCall` (a command resolved to one registered tool); `ServerKey` names a server by its tool type
and namespace, and the meta tools answer under `META_NAMESPACE`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from tether.protocol.models import ToolInfo, ToolType

if TYPE_CHECKING:
    from tether.device.mcp.client.manager import BaseMCPServer
    from tether.device.mcp.client.toolset_server import ToolSetServer
    from tether.tools.runtime import ToolSpec

META_NAMESPACE = "meta"

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
