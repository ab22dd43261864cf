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

The package's parts, each with one job: `entries` (what the registry holds), `registry` (listing, collisions,
resolving a command), `joining` (external servers joining after start-up), `running` (calling a resolved tool)
and `core` (the `Computer` made of them); around them, `manager` (one `Computer` per agent and root, made on first
use) and `router` (a batch of commands run on the right `Computer`). Import those two modules themselves.
"""

from tether.device.computer.core import Computer
from tether.device.computer.entries import META_NAMESPACE, MCPToolCall, ServerKey, ToolEntry
from tether.device.computer.joining import JOIN_WAIT_S

__all__ = ["JOIN_WAIT_S", "META_NAMESPACE", "Computer", "MCPToolCall", "ServerKey", "ToolEntry"]
