"""`Gateway`: the fleet as an MCP server, streamable HTTP at `/mcp` on the agent server's port.

Built on the official SDK's low-level `Server` (its tool list is computed per request, which the fleet
needs: devices come and go) and `StreamableHTTPSessionManager`. In front of the SDK sits an ASGI check of
the API token (`Authorization: Bearer`; 401 `{"error": …}` with `WWW-Authenticate: Bearer resource_metadata=…`
(RFC 9728, front/resource_metadata.py) without a valid one, 403 for a device token or a token without `read`),
repeated on every request so a revoked token stops at once; an MCP session stays bound to the token that
opened it. The app's `RequestGuard` (Host/Origin, body caps) runs before all of this, as for every route.

Scopes: `read` lists (every request needs it), `execute` calls device tools, `approve` answers approvals
and questions (a person's token only: an agent's never approves, docs/security/approvals.md); a
contributed tool names its own. A call a token may not make is a tool error saying which
scope is missing, never a silent refusal.

Clients of the handshake era (protocol 2025-xx, what today's desktop and IDE clients speak) are told
`notifications/tools/list_changed` on their session's stream when a device they list registers, leaves or
reports new tools (and resources/prompts `list_changed` when its external MCP servers came or went);
clients of the 2026-07-28 era get the same through `subscriptions/listen` (handlers/watch.py, handlers/listen.py),
and may follow their tasks there (`taskIds`). A client of the tasks extension gets device calls that ask or
run long (handlers/tasks.py) and the agent's `run_task` (handlers/tool_tasks.py) as tasks.
Each request is answered with one JSON body unless its call streams something first (front/transport.py).

The package's parts, each with one job: `fleet_server` (the SDK's server: handshake, cache hints, instructions),
`questions` (2026-07-28 questions answered by retrying the call), `lists` (tools, resources and prompts),
`calls` (tools/call) and `core` (the `Gateway` made of them, and who may come in).
"""

from tether.server.mcp.gateway.calls import MAX_NAME_ECHO
from tether.server.mcp.gateway.core import MAX_SESSIONS_PER_TOKEN, Gateway
from tether.server.mcp.gateway.fleet_server import CACHE_HINTS, INSTRUCTIONS, LIST_TTL_MS
from tether.server.mcp.gateway.questions import MAX_DEFERRED, QUESTION_KEY

__all__ = ["CACHE_HINTS", "INSTRUCTIONS", "LIST_TTL_MS", "MAX_DEFERRED", "MAX_NAME_ECHO", "MAX_SESSIONS_PER_TOKEN",
           "QUESTION_KEY", "Gateway"]
