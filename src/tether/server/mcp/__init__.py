"""The fleet as an MCP server: the gateway mounted at `/mcp` on the agent server.

The app factory mounts it; it imports nothing from `server/web`, `server/cluster` or `tether.agent`.
Layers above the server (the agent's task tools) add their tools through `contributed.py`.
"""
