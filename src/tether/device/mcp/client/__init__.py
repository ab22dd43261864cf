"""The MCP servers a device calls tools on, each a `BaseMCPServer` (`base`): the built-in tool sets
(`toolset_server`), the external servers and their sessions (`servers`, `external`, `stdio`, `session_util`),
what the device offers them beyond tool calls (`client_caps`, `elicit`, `resources`), and the manager that
owns them all (`manager`). Nothing is imported here, so a device whose tools are all built in never imports
the `mcp` SDK."""
