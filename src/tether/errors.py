"""tether's one error tree: every error tether raises derives from `TetherError`.

    TetherError
    ├── ConfigError        a configuration file, policy or setting is invalid
    ├── ProtocolError      an AIP frame, model or identity proof is malformed or refused
    ├── SandboxError       a confined process could not be started, limited or its changes applied
    ├── ToolError          a tool ran and failed, or the policy refused or held the call
    ├── DeviceError        the device client: its link, its MCP servers, its configuration
    ├── ServerError        the agent server: routing, pairing, the store, the cluster
    ├── AgentError         planning, the LLM, task execution and recovery
    └── ClientError        talking to a server from Python or the CLI (REST, the typed client)

A leaf keeps its builtin base as well (for example ``class FrameError(ProtocolError, ValueError)``), so
code that caught the builtin before still does. This module imports nothing: every layer may use it.
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
