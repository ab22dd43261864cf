"""The tool runtime, the policy, and one sub-package per built-in tool family.

Shared by every family, at this level: `runtime` (the `tool` decorator, `ToolFunction`, `ToolSet`),
`context` (`ToolContext`, what a tool may know about its call) and `errors` (what a tool raises to fail
its command, and `MissingDependency`, what a missing extra raises). `toolsets/` holds whole tool sets
(`builtin`, the sets a device loads by name; `mcp_export`, a tool set served over MCP); `running/` how a
tool runs a program (`process`) and the sandbox a policy asks for (`sandboxing`); `journal/` the undo
journal; `policy/` the rules every tool obeys.

The families — `shell/`, `files/`, `system/`, `desktop/`, `browser/` — share one inner shape: `tool.py`
builds the family's `ToolSet`, next to the family's own rules and helpers.

Importing this package imports nothing else; import the module you need.
"""
