"""The MCP servers a device calls (built-in tool sets, external servers) and the device as an MCP server."""
