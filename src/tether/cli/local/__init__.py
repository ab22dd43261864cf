"""Local mode's own parts: what the CLI needs when it runs a device and its tasks in its own process — the
local task store and its run locks, with questions asked at this terminal (`tasks`), and who answers an external
MCP server's questions and sampling requests (`mcp_hooks`: the person at the terminal, the configured LLM; a
remote device's questions too). This package imports nothing itself."""
