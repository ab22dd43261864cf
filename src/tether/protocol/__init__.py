"""AIP wire models: pure data, no I/O, imports nothing else from tether.

The names below are loaded lazily (`tether.imports`): importing one module of the package, such as
`tether.protocol.models` for `Command` and `Result`, does not build the models of the others (the frames,
the profile, the codec), which a command that never talks AIP (`tether exec`, `tether --help`) never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.imports import lazy_import

if TYPE_CHECKING:
    from tether.protocol.codec import FrameError, decode_client_message, decode_server_message, encode
    from tether.protocol.dispatcher import BasicCommandDispatcher
    from tether.protocol.identity import CHALLENGE_HEADER, KeyProof
    from tether.protocol.messages import (
        PROTOCOL_VERSION,
        ClientMessage,
        ClientMessageType,
        Event,
        RegisterAck,
        Registration,
        ServerMessage,
        ServerMessageType,
        TaskStatus,
    )
    from tether.protocol.models import Command, Result, ResultStatus, ToolInfo, ToolType
    from tether.protocol.profile import DeviceProfile, DeviceRequirements
    from tether.protocol.wire import CloseCode
else:
    __getattr__, __dir__ = lazy_import(globals(), {
        **dict.fromkeys(["FrameError", "decode_client_message", "decode_server_message", "encode"],
                        "tether.protocol.codec"),
        "BasicCommandDispatcher": "tether.protocol.dispatcher",
        **dict.fromkeys(["CHALLENGE_HEADER", "KeyProof"], "tether.protocol.identity"),
        **dict.fromkeys(["PROTOCOL_VERSION", "ClientMessage", "ClientMessageType", "Event", "RegisterAck",
                         "Registration", "ServerMessage", "ServerMessageType", "TaskStatus"],
                        "tether.protocol.messages"),
        **dict.fromkeys(["Command", "Result", "ResultStatus", "ToolInfo", "ToolType"], "tether.protocol.models"),
        **dict.fromkeys(["DeviceProfile", "DeviceRequirements"], "tether.protocol.profile"),
        "CloseCode": "tether.protocol.wire",
    })

__all__ = [
    "CHALLENGE_HEADER",
    "PROTOCOL_VERSION",
    "BasicCommandDispatcher",
    "ClientMessage",
    "ClientMessageType",
    "CloseCode",
    "Command",
    "DeviceProfile",
    "DeviceRequirements",
    "Event",
    "FrameError",
    "KeyProof",
    "RegisterAck",
    "Registration",
    "Result",
    "ResultStatus",
    "ServerMessage",
    "ServerMessageType",
    "TaskStatus",
    "ToolInfo",
    "ToolType",
    "decode_client_message",
    "decode_server_message",
    "encode",
]
