"""The tool runtime, the policy, and one sub-package per built-in tool family.

Shared by every family, at this level: `runtime` (the `tool` decorator, `ToolFunction`, `ToolSet`),
`context` (`ToolContext`, what a tool may know about its call), `errors`, `builtin` (the tool sets a
device loads by name), `optional` (what a missing extra raises), `process` (running one program),
`journal` (the undo journal), `sandboxing` (the sandbox a policy asks for) and `mcp_export` (a tool
set served over MCP). `policy/` holds the rules every tool obeys.

The families — `shell/`, `files/`, `system/`, `desktop/`, `browser/` — share one inner shape: `tool.py`
builds the family's `ToolSet`, next to the family's own rules and helpers.

Importing this package imports nothing else; import the module you need.
"""
