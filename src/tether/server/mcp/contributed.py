"""Tools a layer above the server adds to the MCP gateway, without the server importing that layer.

The agent's task tools (`run_task`, `get_task`, …) live in `tether.agent`; the server must not import
it. The agent's app extension calls `contribute(app, [...])` when it is built, and the gateway lists
and calls whatever has been contributed, next to its own fleet and device tools. A handler gets a
`GatewayCall`: who asks (for scopes and the audit), and the client's channels back to it (progress,
elicitation), each a no-op or `None` when the client did not offer it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette

from tether.server.store.tokens import TokenInfo

Scope = Literal["read", "execute", "approve"]

# (progress, total or None, message or None): sent as notifications/progress when the client gave a token
Progress = Callable[[float, float | None, str | None], Awaitable[None]]
# (message, requested JSON schema) -> {"action": "accept"|"decline"|"cancel", "content": {...} | None}
Elicit = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class GatewayCall:
    """What a contributed tool's handler may use while it runs."""

    token: TokenInfo
    client: str  # the MCP client's clientInfo as "name/version", recorded in the audit
    progress: Progress
    elicit: Elicit | None  # None when the client did not declare the elicitation capability


@dataclass(frozen=True)
class GatewayReply:
    """A tool's answer: `text` for every client, `structured` for those that read structuredContent."""

    text: str
    structured: dict[str, Any] | None = None
    is_error: bool = False


Handler = Callable[[dict[str, Any], GatewayCall], Awaitable[GatewayReply]]


@dataclass(frozen=True)
class GatewayTool:
    """One contributed tool, listed with the fleet tools whatever the device filter is."""

    name: str
    description: str
    input_schema: dict[str, Any]
    scope: Scope  # the token scope a call needs; listing needs `read`
    handler: Handler
    output_schema: dict[str, Any] | None = None
    read_only: bool = False
    destructive: bool = False
    annotations: dict[str, Any] = field(default_factory=dict)


def contribute(app: Starlette, tools: Iterable[GatewayTool]) -> None:
    """Add tools to the gateway of `app`; a name given twice is a programming error."""
    have: dict[str, GatewayTool] = getattr(app.state, "gateway_tools", None) or {}
    for tool in tools:
        if tool.name in have:
            raise ValueError(f"gateway tool {tool.name!r} contributed twice")
        have[tool.name] = tool
    app.state.gateway_tools = have


def contributed(app: Starlette) -> dict[str, GatewayTool]:
    """The contributed tools of `app`, by name (empty when nothing was contributed)."""
    return dict(getattr(app.state, "gateway_tools", None) or {})
