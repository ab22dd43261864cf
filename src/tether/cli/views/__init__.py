"""What the `tether` commands draw on a terminal: task and fan-out progress, the status line, plan previews,
MCP content, the help panels, the services' log lines (`logs`), and the escaping of untrusted text
(`safe_text`) every view prints through.
Views import no command module. This package imports nothing itself."""
