"""What serves the gateway's MCP requests beside its tool list and calls: the request's context (who calls,
from which client, with which capabilities), the devices' external servers' resources and prompts, and the
tasks extension."""
