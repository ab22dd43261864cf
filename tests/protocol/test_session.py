"""`protocol.server_session.ServerSession` on frames alone: no socket, no server, no store."""

from __future__ import annotations

import pytest

from tether.protocol.codec import encode
from tether.protocol.messages import ClientMessage, ClientMessageType, Event, Registration, TaskStatus
from tether.protocol.profile import DeviceProfile
from tether.protocol.server_session import (
    BadFrame,
    DeviceReportedError,
    EventArrived,
    HeartbeatArrived,
    PolicyReported,
    ProfileReported,
    RegisteredAgain,
    RegistrationRefused,
    ResultsArrived,
    SamplingRequested,
    ServerSession,
    SessionState,
)
from tether.protocol.wire import CloseCode

LIMIT = 1 << 20


def frame(kind: ClientMessageType, payload: object = None, **fields: object) -> str:
    return encode(ClientMessage(type=kind, payload=payload, **fields))  # type: ignore[arg-type]


def register(name: str | None = "laptop") -> str:
    reg = Registration(name=name, instance_id="i-1", profile=DeviceProfile())
    return frame(ClientMessageType.REGISTER, reg.model_dump())


def opened() -> ServerSession:
    session = ServerSession("laptop", LIMIT)
    assert isinstance(session.register(register()), Registration)
    session.open()
    return session


def test_the_first_frame_must_be_the_register_of_the_tokens_device() -> None:
    session = ServerSession("laptop", LIMIT)
    assert session.state is SessionState.REGISTERING
    reg = session.register(register())
    assert isinstance(reg, Registration) and reg.instance_id == "i-1"
    assert isinstance(ServerSession("laptop", LIMIT).register(register(None)), Registration)  # no claim: the token's
    cases = [
        (register("desktop"), CloseCode.WRONG_DEVICE, "belongs to device 'laptop'"),
        ("not json", CloseCode.BAD_REGISTRATION, "registration refused"),
        (frame(ClientMessageType.HEARTBEAT), CloseCode.BAD_REGISTRATION, "must be a register"),
        (frame(ClientMessageType.REGISTER, {"instance_id": 5}), CloseCode.BAD_REGISTRATION, "invalid registration"),
    ]
    for text, code, why in cases:
        verdict = ServerSession("laptop", LIMIT).register(text)
        assert isinstance(verdict, RegistrationRefused), text
        assert verdict.code is code and why in verdict.error, (text[:80], verdict)
    too_big = ServerSession("laptop", 64).register(register())
    assert isinstance(too_big, RegistrationRefused) and "registration refused" in too_big.error


def test_the_calls_must_come_in_order() -> None:
    session = ServerSession("laptop", LIMIT)
    with pytest.raises(RuntimeError):
        session.receive(frame(ClientMessageType.HEARTBEAT))
    session.register(register())
    session.open()
    assert session.state is SessionState.OPEN
    with pytest.raises(RuntimeError):
        session.register(register())
    with pytest.raises(RuntimeError):
        session.open()
    session.close()
    assert session.state is SessionState.CLOSED
    with pytest.raises(RuntimeError):
        session.receive(frame(ClientMessageType.HEARTBEAT))


def test_each_message_of_an_open_session_becomes_its_event() -> None:
    session = opened()
    results = session.receive(frame(ClientMessageType.COMMAND_RESULTS, prev_response_id="b1",
                                    status=TaskStatus.COMPLETED, action_results=[]))
    assert isinstance(results, ResultsArrived) and results.message.prev_response_id == "b1"
    assert session.last_type is ClientMessageType.COMMAND_RESULTS
    event = Event(kind="output", response_id="b1", data={"text": "hi"})
    arrived = session.receive(frame(ClientMessageType.EVENT, event.model_dump(mode="json")))
    assert isinstance(arrived, EventArrived) and arrived.event.response_id == "b1"
    profile = session.receive(frame(ClientMessageType.DEVICE_INFO, DeviceProfile().model_dump(mode="json")))
    assert isinstance(profile, ProfileReported) and isinstance(profile.profile, DeviceProfile)
    assert isinstance(session.receive(frame(ClientMessageType.POLICY_REPORT, {"version": 1},
                                            prev_response_id="p1")), PolicyReported)
    assert isinstance(session.receive(frame(ClientMessageType.SAMPLING_REQUEST, {"server": "s"})), SamplingRequested)
    error = session.receive(frame(ClientMessageType.ERROR, error="nope", prev_response_id="b1"))
    assert isinstance(error, DeviceReportedError) and error.message.error == "nope"
    again = session.receive(register())
    assert isinstance(again, RegisteredAgain) and "already registered as laptop" in again.error


def test_a_heartbeat_reports_its_load_only_when_it_is_valid() -> None:
    session = opened()

    def load(payload: object) -> tuple[int, int] | None:
        beat = session.receive(frame(ClientMessageType.HEARTBEAT, payload))
        assert isinstance(beat, HeartbeatArrived)
        return beat.load

    assert load(None) == (0, 0)
    assert load({"running": 3, "queued": 2}) == (3, 2)
    assert load({"running": 3, "queued": 4}) == (3, 0)  # more queued than running: queued is not believed
    assert load({"running": 2, "queued": "1"}) == (2, 0)
    assert load({"running": -1}) is None
    assert load({"running": "3"}) is None
    assert load({"running": True}) is None  # a bool is not a count


def test_what_cannot_be_read_is_a_bad_frame_never_an_exception() -> None:
    session = opened()
    unreadable = session.receive("{not json")
    assert isinstance(unreadable, BadFrame) and unreadable.frame_error and session.last_type is None
    bad_event = session.receive(frame(ClientMessageType.EVENT, {"kind": 5}))
    assert isinstance(bad_event, BadFrame) and not bad_event.frame_error and bad_event.reason == "invalid"
    assert bad_event.error.startswith("invalid event payload: ")
    bad_info = session.receive(frame(ClientMessageType.DEVICE_INFO, {"tools": "many"}))
    assert isinstance(bad_info, BadFrame) and bad_info.error.startswith("invalid device_info payload: ")
    small = ServerSession("laptop", 256)
    small.register(register())
    small.open()
    over = small.receive(frame(ClientMessageType.EVENT, {"kind": "output", "data": {"text": "x" * 300}}))
    assert isinstance(over, BadFrame) and over.frame_error
