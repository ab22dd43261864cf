"""What external MCP servers ask through a device (questions, sampling requests) and the answers sent back."""
