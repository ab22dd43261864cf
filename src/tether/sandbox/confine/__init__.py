"""How one process is confined: the sandbox's specification and the kernel mechanisms that enforce it.

`spec` (SandboxSpec), `bwrap` (the bubblewrap arguments), `guard` (hidden and protected paths in a
live view), `landlock`, `seccomp`, `limits` (resource limits), `run_as` (a root device's sandbox user),
`warden` (the process inside bubblewrap that starts each command; run as
`python -I -m tether.sandbox.confine.warden`, or `bwrap.WARDEN_START`: so what it imports stays standard
library only) and `command` (each command's own process, which the warden clones: its mounts, confinement and
program).
Import the modules themselves: this file imports nothing, which keeps the warden's start cheap.
"""
