"""Whole tool sets: `builtin` (the sets a device loads by name) and `mcp_export` (a tool set served over MCP).

Importing this package imports nothing else; import the module you need.
"""
