"""The server end of one AIP session as a sans-I/O state machine: frames in, what they mean out.

`ServerSession` reads the text frames a device sends and says what each one means, without a
socket, a clock, a store or a task (websockets' `protocol.py` is the model): the first frame must be
the REGISTER of the device the connection's token names, and every later frame is decoded and
validated into one `SessionEvent`. The caller (the server's hub) owns the I/O and the decisions —
whether the key proof holds, which batch a result belongs to, what to answer, which frames to write.

    session = ServerSession("laptop", max_frame_bytes)
    verdict = session.register(first_frame)      # Registration, or RegistrationRefused
    ...                                           # the caller proves the key, sends the ack
    session.open()                                # later frames are the device's messages
    event = session.receive(frame)                # ResultsArrived, HeartbeatArrived, …, BadFrame

Nothing here raises for what a device sends: a frame that cannot be read is a `BadFrame` (or a
`RegistrationRefused` before registration), with the reason the device is told.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pydantic import ValidationError

from tether.protocol.codec import FrameError, decode_client_message
from tether.protocol.messages import (
    ClientMessage,
    ClientMessageType,
    Event,
    Registration,
)
from tether.protocol.profile import DeviceProfile
from tether.protocol.wire import CloseCode


class SessionState(Enum):
    """Where a session is: waiting for the REGISTER, open for messages, or closed."""

    REGISTERING = "registering"
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class RegistrationRefused:
    """The first frame is not an acceptable REGISTER: `error` is what the device is told, `code` the close
    code (`CloseCode.WRONG_DEVICE` for a registration of another device than the token's, else
    `CloseCode.BAD_REGISTRATION`)."""

    code: CloseCode
    error: str


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame that could not be read or whose payload is invalid: the device is told `error` (`reason`
    is the ERROR frame's machine-readable reason); `frame_error` when the frame itself was unreadable."""

    error: str
    reason: str
    frame_error: bool = False


@dataclass(frozen=True, slots=True)
class ResultsArrived:
    """COMMAND_RESULTS for the batch `message.prev_response_id`."""

    message: ClientMessage


@dataclass(frozen=True, slots=True)
class HeartbeatArrived:
    """A heartbeat; `load` is (running, queued) when it reported a valid load, else None. `queued` is 0
    when it was not a whole number between 0 and `running`."""

    load: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class EventArrived:
    """A valid progress event of the batch `event.response_id`."""

    event: Event


@dataclass(frozen=True, slots=True)
class ProfileReported:
    """A valid DEVICE_INFO: the device's new profile."""

    profile: DeviceProfile


@dataclass(frozen=True, slots=True)
class PolicyReported:
    """A POLICY_REPORT answering `message.prev_response_id`."""

    message: ClientMessage


@dataclass(frozen=True, slots=True)
class OutcomesReported:
    """An OUTCOME_REPORT answering the OUTCOME_QUERY `message.prev_response_id` (its payload checked)."""

    message: ClientMessage


@dataclass(frozen=True, slots=True)
class SamplingRequested:
    """A SAMPLING_REQUEST of an external MCP server of the device."""

    message: ClientMessage


@dataclass(frozen=True, slots=True)
class DeviceReportedError:
    """An ERROR frame of the device, about the batch `message.prev_response_id` when it names one."""

    message: ClientMessage


@dataclass(frozen=True, slots=True)
class RegisteredAgain:
    """A REGISTER after the session opened; the device is told `error`."""

    error: str


SessionEvent = (BadFrame | ResultsArrived | HeartbeatArrived | EventArrived | ProfileReported | PolicyReported
                | OutcomesReported | SamplingRequested | DeviceReportedError | RegisteredAgain)


class ServerSession:
    """One device connection's frames, judged. `device` is the name the connection's token gives,
    `max_frame_bytes` the largest frame read. Use `register` once, `open` once the caller accepted the
    registration, then `receive` for each frame; `close` when the connection ends. Calling them out
    of that order raises `RuntimeError` (a bug of the caller, not of the device)."""

    def __init__(self, device: str, max_frame_bytes: int) -> None:
        self.device = device
        self.max_frame_bytes = max_frame_bytes
        self.state = SessionState.REGISTERING
        self.last_type: ClientMessageType | None = None  # the type of the last frame read, None if unreadable

    def register(self, frame: str) -> Registration | RegistrationRefused:
        """The REGISTER of the token's device, from the connection's first frame, or why it is refused."""
        if self.state is not SessionState.REGISTERING:
            raise RuntimeError(f"register() in state {self.state.value}")
        try:
            msg = decode_client_message(frame, self.max_frame_bytes)
            if msg.type is not ClientMessageType.REGISTER:
                raise FrameError("not_register", f"the first frame must be a register message, not {msg.type.value}")
            reg = Registration.model_validate(msg.payload)
        except FrameError as exc:
            return RegistrationRefused(CloseCode.BAD_REGISTRATION, f"registration refused: {exc}")
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
            return RegistrationRefused(CloseCode.BAD_REGISTRATION, f"invalid registration: {problems}")
        if reg.name is not None and reg.name != self.device:
            return RegistrationRefused(CloseCode.WRONG_DEVICE, f"this token belongs to device '{self.device}' "
                                                              f"but the registration claims to be '{reg.name}'")
        return reg

    def open(self) -> None:
        """The caller accepted the registration (its REGISTER_ACK is sent): later frames are messages."""
        if self.state is not SessionState.REGISTERING:
            raise RuntimeError(f"open() in state {self.state.value}")
        self.state = SessionState.OPEN

    def close(self) -> None:
        """The connection ended; nothing more is read."""
        self.state = SessionState.CLOSED

    def receive(self, frame: str) -> SessionEvent:
        """What one frame of an open session means; never raises for what the device sent."""
        if self.state is not SessionState.OPEN:
            raise RuntimeError(f"receive() in state {self.state.value}")
        self.last_type = None
        try:
            msg = decode_client_message(frame, self.max_frame_bytes)
        except FrameError as exc:
            return BadFrame(str(exc), exc.reason, frame_error=True)
        self.last_type = msg.type
        return self.judge(msg)

    def judge(self, msg: ClientMessage) -> SessionEvent:
        """What a decoded message of an open session means (its payload validated)."""
        kind = msg.type
        if kind is ClientMessageType.COMMAND_RESULTS:
            return ResultsArrived(msg)
        if kind is ClientMessageType.HEARTBEAT:
            running = (msg.payload or {}).get("running", 0)
            queued = (msg.payload or {}).get("queued", 0)  # of `running`, those not started yet
            if type(queued) is not int or not 0 <= queued <= (running if type(running) is int else 0):
                queued = 0
            return HeartbeatArrived((running, queued) if type(running) is int and running >= 0 else None)
        if kind is ClientMessageType.EVENT:
            try:
                return EventArrived(Event.model_validate(msg.payload))
            except ValidationError as exc:
                return BadFrame(f"invalid event payload: {exc.errors()[0]['msg']}", "invalid")
        if kind is ClientMessageType.POLICY_REPORT:
            return PolicyReported(msg)
        if kind is ClientMessageType.OUTCOME_REPORT:
            return OutcomesReported(msg)
        if kind is ClientMessageType.DEVICE_INFO:
            try:
                return ProfileReported(DeviceProfile.model_validate(msg.payload or {}))
            except ValidationError as exc:
                return BadFrame(f"invalid device_info payload: {exc.errors()[0]['msg']}", "invalid")
        if kind is ClientMessageType.SAMPLING_REQUEST:
            return SamplingRequested(msg)
        if kind is ClientMessageType.ERROR:
            return DeviceReportedError(msg)
        return RegisteredAgain(f"already registered as {self.device}; register only as the first frame")

