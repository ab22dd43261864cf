"""The agent server: AIP endpoint, device registry, dispatchers and the durable store."""
