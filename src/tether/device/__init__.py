"""The device client: MCP servers, Computer / ComputerManager / CommandRouter, DeviceClient."""
