"""The files family: `tool` (read, list, inspect, write, delete, move — jailed by `tools.policy.jail`,
approved, and journaled in `tools.journal`).

Importing this package imports nothing else; import the module you need.
"""
