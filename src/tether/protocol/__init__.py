"""AIP wire models: pure data, no I/O, imports nothing else from tether."""

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
