"""AIP envelopes (seeds 000-002). One message type per purpose; every frame is versioned and timed."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.models import Command, Result

PROTOCOL_VERSION = "1.0"


def utc_now() -> str:
    return datetime.now(UTC).isoformat()


class ServerMessageType(str, Enum):
    REGISTER_ACK = "register_ack"
    REGISTER_REFUSED = "register_refused"
    HEARTBEAT = "heartbeat"
    COMMAND = "command"
    CANCEL = "cancel"
    DEVICE_INFO_REQUEST = "device_info_request"
    ERROR = "error"


class ClientMessageType(str, Enum):
    REGISTER = "register"
    HEARTBEAT = "heartbeat"
    COMMAND_RESULTS = "command_results"
    EVENT = "event"
    DEVICE_INFO = "device_info"
    ERROR = "error"


class TaskStatus(str, Enum):
    CONTINUE = "continue"
    COMPLETED = "completed"
    FAILED = "failed"
    OK = "ok"
    ERROR = "error"


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid")

    protocol_version: str = PROTOCOL_VERSION
    timestamp: str = Field(default_factory=utc_now)


class ServerMessage(_Envelope):
    """Server → device. A COMMAND carries `actions` and the `response_id` the results must echo."""

    type: ServerMessageType
    status: TaskStatus = TaskStatus.CONTINUE
    response_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None
    task_name: str | None = None
    agent_name: str | None = None
    process_name: str | None = None
    root_name: str | None = None
    actions: list[Command] | None = None
    timeout: float | None = None
    early_exit: bool = True
    error: str | None = None
    payload: dict[str, Any] | None = None


class ClientMessage(_Envelope):
    """Device → server. COMMAND_RESULTS carries `action_results` and `prev_response_id`."""

    type: ClientMessageType
    status: TaskStatus = TaskStatus.OK
    client_id: str | None = None
    session_id: str | None = None
    prev_response_id: str | None = None
    action_results: list[Result] | None = None
    error: str | None = None
    payload: dict[str, Any] | None = None
