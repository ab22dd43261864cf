"""How a device starts processes confined, and how the changes they make are captured and applied.

The operating system is the boundary, not the argument-level policy: every process a device starts
runs under `bubblewrap` (user, mount, pid, ipc, uts and optionally network namespaces; a read-only
view of the machine; the device's secrets hidden; a private `/proc`; killed with its device). Writes
inside the write roots land in a private overlay layer per command, which is listed, held for
approval when the policy reserves a change for a person, and applied (and journaled) afterwards.

Inside: `confine/` (the spec and what enforces it: bubblewrap, Landlock, seccomp, limits, the warden),
`layers/` (the change-capture layers and their apply), `egress/` (the egress proxy and its rules);
`detect` (is a sandbox possible here) and `runner/` (Sandbox: the device's warden, layers and proxy
together) sit on top of them. The three sub-packages import none of each other.

This package imports only `tether.protocol` and the standard library (DESIGN.md's layers).
"""

from tether.sandbox.confine.spec import SandboxSpec, SandboxUnavailable
from tether.sandbox.detect import SandboxInfo, detect

__all__ = ["SandboxInfo", "SandboxSpec", "SandboxUnavailable", "detect"]
