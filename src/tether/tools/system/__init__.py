"""The system family: `info` (what this machine is) and `tool` (what runs on it, starting and closing
programs, and the family's tool set), which launches programs through the command policy and the shell
family's sandbox checks.

Importing this package imports nothing else; import the module you need.
"""
