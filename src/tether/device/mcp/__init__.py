"""The MCP servers a device calls (`client`: built-in tool sets, external servers), how its config describes
them (`config`), and the device as an MCP server (`device_server`)."""
