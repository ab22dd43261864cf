"""The SDK's low-level server as the gateway runs it: its handshake (lists change, tools/call may be a task), the
cache hints of 2026-07-28 results and the instructions a client is given."""


from __future__ import annotations

from typing import Any

import mcp_types as types
from mcp.server import Server
from mcp.server.caching import CacheHint
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.models import InitializationOptions

# cache hints of 2026-07-28 results (ttlMs, cacheScope): every list is the token's own view of the fleet
# (private); a client may reuse a list this long, and hears of a tool-list change sooner through
# subscriptions/listen; a resource is read afresh each time
LIST_TTL_MS = 10_000
CACHE_HINTS = {**{method: CacheHint(ttl_ms=LIST_TTL_MS, scope="private") for method in (
    "tools/list", "resources/list", "resources/templates/list", "prompts/list")},
    "resources/read": CacheHint(ttl_ms=0, scope="private")}
INSTRUCTIONS = ("A tether fleet: `list_devices` shows the machines; each online device's tools are listed as "
                "DEVICE__TOOL (e.g. laptop__shell.run). When the fleet has too many tools to list at once, "
                "tools/list gives only the fleet tools and `find_tools`: search there and call the names it "
                "returns. Calls go through each device's policy and approvals.")

class _FleetServer(Server[Any]):
    """The low-level server, saying in its handshake that its lists change and that tools/call may be a task."""

    def create_initialization_options(self, notification_options: NotificationOptions | None = None,
                                      experimental_capabilities: dict[str, dict[str, Any]] | None = None,
                                      extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        options = super().create_initialization_options(
            notification_options or NotificationOptions(tools_changed=True, resources_changed=True,
                                                        prompts_changed=True),
            experimental_capabilities, extensions)
        # 2025-11-25's core tasks for tools/call (run_task, handlers/task_routes.py; the SDK drops the
        # capability for 2026-07-28, whose tasks are the extension declared beside it)
        options.capabilities.tasks = types.ServerTasksCapability(
            list=types.TasksListCapability(), cancel=types.TasksCancelCapability(),
            requests=types.ServerTasksRequestsCapability(tools=types.TasksToolsCapability(
                call=types.TasksCallCapability())))
        return options
