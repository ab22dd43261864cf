"""What serves the gateway's MCP requests beside its tool list and calls: the request's context (who calls,
from which client, with which capabilities), the devices' external servers' resources and prompts, the tasks
extension, and telling clients that their lists changed (`watch`, `listen`)."""
