"""The device's side of the sandbox: one warm warden, and a process handle per command.

`Sandbox.spawn` sends the warden a `run` request with the program's open file (so what runs is the
file the policy checked, whatever a path inside the sandbox would resolve to) and the command's
stdio pipes; the returned `SandboxedProcess` looks like an asyncio subprocess to the code that
streams output and enforces timeouts. The warden starts on first use and again if it dies.

Inside: `sandbox` (`Sandbox`, made of the parts below), `warden` (its client: start, socket protocol),
`layers` (layers handed out, released and swept; applies seen; the worker pool), `requests` (a request's
mounts, IPC filters and limits), `egress` (the proxy's hooks, a changed network), `process` (a command's
handle), `empty` (is a layer empty), `state` (the constants and the state the parts share).
"""

from tether.sandbox.runner.empty import layer_empty
from tether.sandbox.runner.process import SandboxedProcess
from tether.sandbox.runner.sandbox import Sandbox
from tether.sandbox.runner.state import SWEEP_BATCH

__all__ = ["SWEEP_BATCH", "Sandbox", "SandboxedProcess", "layer_empty"]
