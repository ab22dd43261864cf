"""AIP wire models: pure data, no I/O, imports nothing else from tether."""

from tether.protocol.dispatcher import BasicCommandDispatcher
from tether.protocol.messages import (
    PROTOCOL_VERSION,
    ClientMessage,
    ClientMessageType,
    ServerMessage,
    ServerMessageType,
    TaskStatus,
)
from tether.protocol.models import Command, Result, ResultStatus, ToolInfo, ToolType

__all__ = [
    "PROTOCOL_VERSION",
    "BasicCommandDispatcher",
    "ClientMessage",
    "ClientMessageType",
    "Command",
    "Result",
    "ResultStatus",
    "ServerMessage",
    "ServerMessageType",
    "TaskStatus",
    "ToolInfo",
    "ToolType",
]
