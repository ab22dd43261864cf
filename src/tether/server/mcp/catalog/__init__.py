"""What a gateway client sees of the fleet: the fleet index, its names and device filters (`listing`), and
the list-changed notices and revoked-token ends that follow fleet changes (`watch`). Imports nothing else of
`server/mcp`."""
