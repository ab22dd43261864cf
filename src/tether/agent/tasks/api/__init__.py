"""How tasks are reached from outside the server: the REST task API (`task_api`), the same spoken as MCP tools
(`mcp_tools`), and the approval inbox of what waits for a person (`inbox`)."""
