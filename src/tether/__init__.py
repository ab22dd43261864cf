"""tether: safe, fast and auditable hands for language-model agents on real machines.

The public API, loaded lazily (`import tether` imports nothing else until a name is read):

- talking to a server: `Client`, `AsyncClient` (`tether.client` has their models and errors);
- a device connected to a server: `open_device`, `serve_device`;
- running a server: `create_app`, `run_server`, `ServerSettings`;
- the protocol's models: `Command`, `Result`, `ResultStatus`, `Event`, `ToolInfo`, `ToolType`,
  `DeviceProfile`, `DeviceRequirements`;
- writing tools: `tool`, `ToolContext`, `ToolSet`;
- the error tree: `TetherError` and one base per area (`tether.errors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.imports import lazy_import
from tether.version import __version__ as __version__

__all__ = [
    "AgentError",
    "AsyncClient",
    "Client",
    "ClientError",
    "Command",
    "ConfigError",
    "DeviceError",
    "DeviceProfile",
    "DeviceRequirements",
    "Event",
    "ProtocolError",
    "Result",
    "ResultStatus",
    "SandboxError",
    "ServerError",
    "ServerSettings",
    "TetherError",
    "ToolAreaError",
    "ToolContext",
    "ToolInfo",
    "ToolSet",
    "ToolType",
    "create_app",
    "open_device",
    "run_server",
    "serve_device",
    "tool",
]

if TYPE_CHECKING:
    from tether.client.aio import AsyncClient
    from tether.client.sync import Client
    from tether.device.serve import open_device, serve_device
    from tether.errors import (
        AgentError,
        ClientError,
        ConfigError,
        DeviceError,
        ProtocolError,
        SandboxError,
        ServerError,
        TetherError,
        ToolAreaError,
    )
    from tether.protocol.messages import Event
    from tether.protocol.models import Command, Result, ResultStatus, ToolInfo, ToolType
    from tether.protocol.profile import DeviceProfile, DeviceRequirements
    from tether.server.http.app import create_app
    from tether.server.main import run_server
    from tether.server.settings import ServerSettings
    from tether.tools.context import ToolContext
    from tether.tools.runtime import ToolSet, tool
else:
    __getattr__, __dir__ = lazy_import(globals(), {
        "AsyncClient": "tether.client.aio",
        "Client": "tether.client.sync",
        "open_device": "tether.device.serve",
        "serve_device": "tether.device.serve",
        "ServerSettings": "tether.server.settings",
        "create_app": "tether.server.http.app",
        "run_server": "tether.server.main",
        "Event": "tether.protocol.messages",
        **dict.fromkeys(["Command", "Result", "ResultStatus", "ToolInfo", "ToolType"], "tether.protocol.models"),
        **dict.fromkeys(["DeviceProfile", "DeviceRequirements"], "tether.protocol.profile"),
        "ToolContext": "tether.tools.context",
        **dict.fromkeys(["ToolSet", "tool"], "tether.tools.runtime"),
        **dict.fromkeys(["AgentError", "ClientError", "ConfigError", "DeviceError", "ProtocolError", "SandboxError",
                         "ServerError", "TetherError", "ToolAreaError"], "tether.errors"),
    })
