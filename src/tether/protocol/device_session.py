"""The device end of one AIP session as a sans-I/O state machine: frames in, what they mean out.

`DeviceSession` writes the REGISTER frame a device opens its connection with and reads the text frames
the server sends, without a socket, a clock, a key file or a task (websockets' `protocol.py` is the
model; `server_session.ServerSession` is the other end). The caller (the device's `DeviceConnection`)
owns the I/O and the decisions — when to connect, whether to retry a refusal, what to run, what to answer.

    session = DeviceSession("laptop", instance_id)
    frame = session.register(profile, finished_call_ids, challenge, key)   # the REGISTER to send
    verdict = session.receive(first_reply)     # Registered, Refused, or BadFrame
    ...
    event = session.receive(frame)             # CommandsArrived, CancelArrived, HeartbeatAck, …, BadFrame
    verdict = session.closed(code, reason)     # a close while registering: Refused, or None

States: CONNECTING (nothing sent) → REGISTERING (the REGISTER written, the answer awaited) → OPEN (the
server's REGISTER_ACK read) → CLOSED (refused, or the connection ended). Nothing here raises for what the
server sends: a frame that cannot be read, or that is illegal in the session's state (a COMMAND before the
REGISTER_ACK), is a `BadFrame` saying why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from tether.protocol.codec import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameError,
    decode_server_message,
    encode,
    is_server_heartbeat,
)
from tether.protocol.identity import KeyProof, register_statement
from tether.protocol.messages import (
    CallRef,
    ClientMessage,
    ClientMessageType,
    RegisterAck,
    Registration,
    ServerMessage,
    ServerMessageType,
)
from tether.protocol.profile import DeviceProfile
from tether.protocol.wire import CloseCode

# The close codes by which a server refuses a registration (the socket closed before any answer frame).
REFUSAL_CLOSE_CODES = frozenset({CloseCode.BAD_REGISTRATION, CloseCode.UNAUTHORIZED, CloseCode.KEY_REFUSED,
                                 CloseCode.WRONG_DEVICE, CloseCode.DUPLICATE})


class DeviceSessionState(Enum):
    """Where a device's session is: nothing sent, the REGISTER sent, open for messages, or closed."""

    CONNECTING = "connecting"
    REGISTERING = "registering"
    OPEN = "open"
    CLOSED = "closed"


class Signer(Protocol):
    """What signs the registration's statement: the device's key (`device.link.device_key.DeviceKey`)."""

    @property
    def public_key(self) -> str: ...

    def sign(self, statement: bytes) -> str: ...


@dataclass(frozen=True, slots=True)
class Registered:
    """The server accepted the registration: its REGISTER_ACK."""

    ack: RegisterAck


@dataclass(frozen=True, slots=True)
class Refused:
    """The server refused the registration: `reason` in its words, `code` the socket's close code (None
    while the socket has not closed, or when it closed without one)."""

    code: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame that could not be read (`frame_error`: `reason` is the codec's machine-readable reason, as a
    `FrameError` has it) or that is not acceptable now (the first answer is not a REGISTER_ACK or
    REGISTER_REFUSED, or the ACK is invalid). `error` says why."""

    error: str
    reason: str
    frame_error: bool = False


@dataclass(frozen=True, slots=True)
class HeartbeatAck:
    """The server's answer to a heartbeat: the link lives."""


@dataclass(frozen=True, slots=True)
class CommandsArrived:
    """A COMMAND: the batch `batch.response_id` with its actions."""

    batch: ServerMessage


@dataclass(frozen=True, slots=True)
class CancelArrived:
    """A CANCEL of the batch `response_id`."""

    response_id: str


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    """A POLICY_REQUEST (show the policy) or POLICY_SET (change it): answered by one POLICY_REPORT."""

    message: ServerMessage


@dataclass(frozen=True, slots=True)
class OutcomeQuery:
    """An OUTCOME_QUERY `response_id` about `calls`: answered by one OUTCOME_REPORT, nothing run."""

    response_id: str
    calls: tuple[CallRef, ...]


@dataclass(frozen=True, slots=True)
class ProfileRequested:
    """A DEVICE_INFO_REQUEST `response_id`: answered by a DEVICE_INFO with a fresh profile."""

    response_id: str


@dataclass(frozen=True, slots=True)
class ElicitationAnswer:
    """A person's answer to an external MCP server's question: the ELICITATION_ANSWER's payload."""

    payload: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class SamplingReply:
    """The server's answer to a SAMPLING_REQUEST of the device."""

    message: ServerMessage


@dataclass(frozen=True, slots=True)
class ServerReportedError:
    """An ERROR frame of the server: a frame of the device it could not accept."""

    error: str | None


@dataclass(frozen=True, slots=True)
class Unexpected:
    """A frame of a type that has no meaning in an open session (a second REGISTER_ACK or a REGISTER_REFUSED):
    nothing to do."""

    type: ServerMessageType


HEARTBEAT_ACK = HeartbeatAck()

RegistrationVerdict = Registered | Refused | BadFrame
SessionEvent = (BadFrame | HeartbeatAck | CommandsArrived | CancelArrived | PolicyRequest | OutcomeQuery
                | ProfileRequested | ElicitationAnswer | SamplingReply | ServerReportedError | Unexpected)


class DeviceSession:
    """One connection of a device, its frames written and judged. `name` is the device name it claims
    (None: the token's), `instance_id` its process's random id. Use `register` once, then `receive` for each
    frame the server sends (the first answers the registration, the later ones are messages), `closed`
    when the socket closed. Calling them out of order raises `RuntimeError` (a bug of the caller)."""

    def __init__(self, name: str | None, instance_id: str) -> None:
        self.name = name
        self.instance_id = instance_id
        self.state = DeviceSessionState.CONNECTING
        self.ack: RegisterAck | None = None  # the server's REGISTER_ACK, once read
        self.max_frame_bytes = DEFAULT_MAX_FRAME_BYTES  # the largest frame read: the ACK's limit once open
        self.refusal: Refused | None = None  # the REGISTER_REFUSED read, its close code not known yet

    def register(self, profile: DeviceProfile, finished_call_ids: Sequence[str], challenge: str | None = None,
                 key: Signer | None = None) -> str:
        """The REGISTER frame: `profile`, the call_ids whose results wait to be delivered, and — when the server
        gave a `challenge` (the upgrade's `identity.CHALLENGE_HEADER`) — the proof of `key` signing
        `identity.register_statement` for it. A server that gave no challenge is sent no proof. Raises
        ValueError for a challenge without a key."""
        if self.state is not DeviceSessionState.CONNECTING:
            raise RuntimeError(f"register() in state {self.state.value}")
        proof = None
        if challenge:
            if key is None:
                raise ValueError("the server sent a challenge: a key is needed to answer it")
            proof = KeyProof(public_key=key.public_key,
                             signature=key.sign(register_statement(challenge, self.name, self.instance_id)))
        registration = Registration(name=self.name, instance_id=self.instance_id, profile=profile,
                                    finished_call_ids=list(finished_call_ids), proof=proof)
        self.state = DeviceSessionState.REGISTERING
        return encode(ClientMessage(type=ClientMessageType.REGISTER, client_id=self.name,
                                    payload=registration.model_dump(mode="json",
                                                                    exclude={"proof"} if proof is None else None)))

    def error_frame(self, error: str) -> str:
        """An ERROR frame telling the server `error` (a frame of its that the device could not accept)."""
        return encode(ClientMessage(type=ClientMessageType.ERROR, client_id=self.name, error=error))

    def receive(self, frame: str | bytes) -> RegistrationVerdict | SessionEvent:
        """What one frame from the server means: while registering, the `RegistrationVerdict` (the session
        opens on `Registered`, closes on `Refused`); once open, one `SessionEvent`. Never raises for what
        the server sent."""
        if self.state is DeviceSessionState.OPEN:
            return self.receive_open(frame)
        if self.state is DeviceSessionState.REGISTERING:
            return self.registration_reply(frame)
        raise RuntimeError(f"receive() in state {self.state.value}")

    def receive_open(self, frame: str | bytes) -> SessionEvent:
        """`receive` for an open session (the reader's path: one check less)."""
        if self.state is not DeviceSessionState.OPEN:
            raise RuntimeError(f"receive_open() in state {self.state.value}")
        if is_server_heartbeat(frame, self.max_frame_bytes):  # the common frame, recognised without a model
            return HEARTBEAT_ACK
        try:
            msg = decode_server_message(frame, self.max_frame_bytes)
        except FrameError as exc:
            return BadFrame(str(exc), exc.reason, frame_error=True)
        return self.judge(msg)

    def judge(self, msg: ServerMessage) -> SessionEvent:
        """What a decoded message of an open session means."""
        kind = msg.type
        if kind is ServerMessageType.COMMAND:
            return CommandsArrived(msg)
        if kind is ServerMessageType.CANCEL:
            return CancelArrived(msg.response_id)
        if kind is ServerMessageType.HEARTBEAT:
            return HEARTBEAT_ACK
        if kind in (ServerMessageType.POLICY_REQUEST, ServerMessageType.POLICY_SET):
            return PolicyRequest(msg)
        if kind is ServerMessageType.OUTCOME_QUERY:  # its calls were checked when the frame was decoded
            calls = tuple(CallRef.model_validate(raw) for raw in (msg.payload or {}).get("calls") or [])
            return OutcomeQuery(msg.response_id, calls)
        if kind is ServerMessageType.DEVICE_INFO_REQUEST:
            return ProfileRequested(msg.response_id)
        if kind is ServerMessageType.ELICITATION_ANSWER:
            return ElicitationAnswer(msg.payload)
        if kind is ServerMessageType.SAMPLING_REPLY:
            return SamplingReply(msg)
        if kind is ServerMessageType.ERROR:
            return ServerReportedError(msg.error)
        return Unexpected(kind)

    def registration_reply(self, frame: str | bytes) -> RegistrationVerdict:
        """`receive` for the server's answer to the REGISTER: `Registered` opens the session, `Refused` closes
        it, a `BadFrame` (unreadable, not an ACK or a refusal, an invalid ACK) leaves it to the caller to close."""
        if self.state is not DeviceSessionState.REGISTERING:
            raise RuntimeError(f"registration_reply() in state {self.state.value}")
        try:
            msg = decode_server_message(frame, DEFAULT_MAX_FRAME_BYTES)
        except FrameError as exc:
            return BadFrame(str(exc), exc.reason, frame_error=True)
        if msg.type is ServerMessageType.REGISTER_REFUSED:
            self.state = DeviceSessionState.CLOSED
            self.refusal = Refused(None, msg.error or "no reason given")
            return self.refusal
        if msg.type is not ServerMessageType.REGISTER_ACK:
            return BadFrame(f"expected register_ack, the server sent {msg.type.value}", "not_register_ack")
        try:
            ack = RegisterAck.model_validate(msg.payload or {})
        except ValueError as exc:
            return BadFrame(f"the server's register_ack is invalid: {exc}", "invalid")
        self.ack = ack
        self.max_frame_bytes = ack.max_frame_bytes
        self.state = DeviceSessionState.OPEN
        return Registered(ack)

    def closed(self, code: int | None, reason: str = "") -> Refused | None:
        """The socket closed with `code` and `reason`: while registering, a close with one of
        `REFUSAL_CLOSE_CODES` is the server's refusal, and after a REGISTER_REFUSED frame the refusal gets
        its close code; None otherwise (the link was lost)."""
        state, self.state = self.state, DeviceSessionState.CLOSED
        if self.refusal is not None:
            return Refused(code, self.refusal.reason)
        if state is DeviceSessionState.REGISTERING and code in REFUSAL_CLOSE_CODES:
            return Refused(code, reason or "closed by the server")
        return None
