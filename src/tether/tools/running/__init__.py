"""How a tool runs a program: `process` (one program, its output capped and streamed, its time bounded)
and `sandboxing` (the sandbox a policy asks for, made from the policy's rules).

Importing this package imports nothing else; import the module you need.
"""
