"""The agent server: AIP endpoint, device registry, dispatchers and the durable store.

`main` runs it, `settings` is what it is told, and `ports` names the small interfaces its parts depend on
instead of on each other. One sub-package per job: `aip/` (the devices' sockets, the hub, batches, the
fleet, and what is asked of devices: policy, transfers), `http/` (the REST edge), `mcp/` (the fleet as an
MCP server), `web/` (the dashboard), `cluster/` (several servers as one), `trust/` (device keys, pairing,
OIDC tokens, who may approve, who owns an undo session), `notify/` (webhooks) and `store/` (the database).
"""
