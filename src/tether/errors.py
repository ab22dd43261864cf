"""tether's one error tree: every error tether raises derives from `TetherError`.

    TetherError
    ├── ConfigError        a configuration file, policy or setting is invalid
    ├── ProtocolError      tether.protocol: an AIP frame, model or identity proof is malformed or refused
    ├── SandboxError       tether.sandbox: a confined process could not be started, limited or applied
    ├── ToolAreaError      tether.tools
    │   └── tools.errors.ToolError   a tool failed; its PolicyDenied and NeedsApproval: the policy said no or wait
    ├── DeviceError        tether.device: its link, its MCP servers, its configuration
    ├── ServerError        tether.server: routing, pairing, the store, the cluster
    ├── AgentError         tether.agent: planning, the LLM, task execution and recovery
    └── ClientError        tether.client and the CLI: talking to a server (REST, the typed client)

Every exception class defined in a package derives from that package's base (tests/test_errors.py walks every
module and checks it). A leaf keeps its builtin base as well (for example
``class FrameError(ProtocolError, ValueError)``), so code that caught the builtin before still does; a leaf may
also be a `ConfigError` (``UnsafeBinding``: a server setting that is not safe). This module imports nothing:
every layer, the sandbox included, may use it.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "ClientError",
    "ConfigError",
    "DeviceError",
    "ProtocolError",
    "SandboxError",
    "ServerError",
    "TetherError",
    "ToolAreaError",
]


class TetherError(Exception):
    """The root of every error tether raises; catch it to handle any of them."""


class ConfigError(TetherError):
    """A configuration file, policy or setting is invalid; the message names the key."""


class ProtocolError(TetherError):
    """An AIP frame, model or identity proof is malformed or refused."""


class SandboxError(TetherError):
    """A confined process could not be started or limited, or its captured changes could not be applied."""


class ToolAreaError(TetherError):
    """The base of the tool family's errors (`tether.tools.errors.ToolError` and its leaves)."""


class DeviceError(TetherError):
    """The device client failed: its link to the server, its MCP servers, its local state."""


class ServerError(TetherError):
    """The agent server refused or failed: routing, pairing, the store, the cluster."""


class AgentError(TetherError):
    """Planning, the LLM, a task's execution or its recovery failed."""


class ClientError(TetherError):
    """A call to a tether server from Python or the CLI failed (connection, HTTP status, bad answer)."""
