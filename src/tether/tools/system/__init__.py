"""The system family: `tool` (what this machine is, what runs on it, starting and closing programs),
which launches programs through the command policy and the shell family's sandbox checks.

Importing this package imports nothing else; import the module you need.
"""
