"""The gateway's tools and their calls: one device tool call (`tool_call`), tools and replies as MCP types
(`translate`), the search over device tools (`search`, `find_tools`) and the fleet fan-out (`fanout_tool`,
`run_on_fleet`)."""
