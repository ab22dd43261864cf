"""`tether demo`: a server, a device and commands through them, with no LLM key (`local`: one process;
`remote`: a server and a device as two processes). This package imports nothing itself."""
