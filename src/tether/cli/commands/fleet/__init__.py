"""Commands on the fleet through the server: `devices` (fleet, pairing), `policy`, `audit`, `batch` (audit), `cp`
(transfer), and `exec`, `tools` (tools)."""
