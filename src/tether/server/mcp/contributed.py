"""Tools a layer above the server adds to the MCP gateway, without the server importing that layer.

The agent's task tools (`run_task`, `get_task`, …) live in `tether.agent`; the server must not import
it. The agent's app extension calls `contribute(app, [...])` when it is built, and the gateway lists
and calls whatever has been contributed, next to its own fleet and device tools. A handler gets a
`GatewayCall`: who asks (for scopes and the audit), and the client's channels back to it (progress,
elicitation), each a no-op or `None` when the client did not offer it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from starlette.applications import Starlette

from tether.errors import ServerError
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

TaskStatus = Literal["working", "input_required", "completed", "failed", "cancelled"]


class TaskRefused(ServerError, ValueError):
    """A task request the tool's tasks refuse (an answer this token may not give, a question no longer
    open): the gateway answers it as a JSON-RPC invalid-params error carrying this message."""


@dataclass(frozen=True)
class TaskView:
    """A contributed tool's task as the MCP tasks extension shows it: its `status`, a `message` for a
    person or model, the questions this caller may answer now (`questions`: key -> (message, requested
    JSON schema), each key used for one question only), and the tool's final `reply` once `completed`."""

    status: TaskStatus
    message: str | None = None
    questions: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    reply: GatewayReply | None = None


class ToolTasks(Protocol):
    """How a contributed tool runs as a task (MCP's tasks extension): the gateway keeps which token's task
    it is and answers the protocol; this says what the task is. Each method raises `TaskRefused` for what
    the caller may not do or what no longer holds."""

    async def start(self, arguments: dict[str, Any], call: GatewayCall) -> str | GatewayReply:
        """Start the work: its task id (unguessable), or the tool's reply when nothing was started (bad
        arguments, a refusal)."""
        ...

    async def view(self, task_id: str, call: GatewayCall) -> TaskView:
        """The task now, as `call` (its token, whether its client can be asked) may see it."""
        ...

    async def answer(self, task_id: str, key: str, response: dict[str, Any], call: GatewayCall) -> None:
        """`response` (`{"action", "content"}`, an elicitation result) to the question `key`; a key not open
        now is ignored."""
        ...

    async def cancel(self, task_id: str, call: GatewayCall) -> None:
        """Stop the task (its running work stops); one that has ended is left as it is."""
        ...

    def changes(self, task_id: str) -> AsyncIterator[None]:
        """Yields each time the task may have changed; ends when it has ended (or can no longer be followed
        here)."""
        ...


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
    tasks: ToolTasks | None = None  # set: a client of the tasks extension gets a task handle at once


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
