"""Commands that set things up: `server`, `device`, `token` (server), their services (systemd) and `mcp` (mcp_*)."""
