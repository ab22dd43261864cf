"""How a device config describes an MCP server (`server_config`) and which of its tools the device lists,
calls and puts before a person (`tool_rules`)."""
