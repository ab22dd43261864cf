"""Commands that set things up, one module each: `server`, `device`, `devices`, `token`, their services (systemd)
and `mcp` (mcp_*); `settings` holds what the server and token commands share (`--db`, the server's settings)."""
