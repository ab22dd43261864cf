"""Tasks on the agent server: the task service (`service`), their store (`store`), the task API and its MCP
tools (`task_api`, `mcp_tools`), and what several servers or a restarted one do (`ownership`, `peers`,
`restart`)."""
