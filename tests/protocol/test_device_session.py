"""`protocol.device_session.DeviceSession` on frames alone: no socket, no server, no key file."""

from __future__ import annotations

import json

import pytest

from tether.protocol.codec import decode_client_message, encode
from tether.protocol.device_session import (
    REFUSAL_CLOSE_CODES,
    BadFrame,
    CancelArrived,
    CommandsArrived,
    DeviceSession,
    DeviceSessionState,
    ElicitationAnswer,
    HeartbeatAck,
    OutcomeQuery,
    PolicyRequest,
    ProfileRequested,
    Refused,
    Registered,
    SamplingReply,
    ServerReportedError,
    Unexpected,
)
from tether.protocol.identity import register_statement
from tether.protocol.messages import (
    ClientMessageType,
    RegisterAck,
    Registration,
    ServerMessage,
    ServerMessageType,
)
from tether.protocol.profile import DeviceProfile
from tether.protocol.server_session import ServerSession
from tether.protocol.wire import SERVER_HEARTBEAT, CloseCode

ACK = RegisterAck(device="laptop", heartbeat_interval=10, heartbeat_timeout=30, grace_period=60,
                  max_frame_bytes=4096)
COMMAND = {"actions": [{"tool_name": "shell", "parameters": {"command": "true"}, "call_id": "c1"}]}


class FakeKey:
    """A signer that signs nothing: it remembers what it was asked to sign."""

    public_key = "A" * 43

    def __init__(self) -> None:
        self.signed: list[bytes] = []

    def sign(self, statement: bytes) -> str:
        self.signed.append(statement)
        return "S" * 86


def server(kind: ServerMessageType, **fields: object) -> str:
    return encode(ServerMessage(type=kind, **fields))


def registering(name: str | None = "laptop") -> DeviceSession:
    session = DeviceSession(name, "i-1")
    session.register(DeviceProfile(), [])
    return session


def opened() -> DeviceSession:
    session = registering()
    assert isinstance(session.receive(server(ServerMessageType.REGISTER_ACK, payload=ACK.model_dump())), Registered)
    return session


def test_the_happy_registration() -> None:
    session = DeviceSession("laptop", "i-1")
    assert session.state is DeviceSessionState.CONNECTING
    frame = session.register(DeviceProfile(), ["c7", "c8"])
    assert session.state in (DeviceSessionState.REGISTERING,)  # (a tuple: mypy keeps the narrowing of above)
    msg = decode_client_message(frame)
    assert msg.type is ClientMessageType.REGISTER and msg.client_id == "laptop"
    assert "proof" not in (msg.payload or {})  # no challenge, no proof: an older server knows no such field
    reg = Registration.model_validate(msg.payload)
    assert (reg.name, reg.instance_id, reg.finished_call_ids) == ("laptop", "i-1", ["c7", "c8"])
    # the server's end reads it as a registration of its device
    assert isinstance(ServerSession("laptop", 1 << 20).register(frame), Registration)
    verdict = session.receive(server(ServerMessageType.REGISTER_ACK, payload={**ACK.model_dump(), "resumed": True}))
    assert isinstance(verdict, Registered) and verdict.ack.resumed and verdict.ack.device == "laptop"
    assert session.state is DeviceSessionState.OPEN and session.ack == verdict.ack
    assert session.max_frame_bytes == 4096  # the ACK's limit holds from now on
    assert session.closed(1000) is None and session.state is DeviceSessionState.CLOSED


def test_the_key_challenge_is_answered_with_a_proof_of_this_registration() -> None:
    key = FakeKey()
    session = DeviceSession("laptop", "i-1")
    frame = session.register(DeviceProfile(), [], "the-challenge", key)
    assert key.signed == [register_statement("the-challenge", "laptop", "i-1")]
    proof = Registration.model_validate(decode_client_message(frame).payload).proof
    assert proof is not None and proof.public_key == key.public_key and proof.signature == "S" * 86
    with pytest.raises(ValueError, match="challenge"):
        DeviceSession("laptop", "i-1").register(DeviceProfile(), [], "the-challenge")


def test_a_refusal_frame_gets_the_close_code_that_follows_it() -> None:
    session = registering()
    verdict = session.receive(server(ServerMessageType.REGISTER_REFUSED, error="unsupported version"))
    assert verdict == Refused(None, "unsupported version") and session.state is DeviceSessionState.CLOSED
    assert session.closed(CloseCode.BAD_REGISTRATION, "") == Refused(CloseCode.BAD_REGISTRATION,
                                                                     "unsupported version")
    with pytest.raises(RuntimeError):
        session.receive(server(ServerMessageType.HEARTBEAT))


@pytest.mark.parametrize("code", sorted(REFUSAL_CLOSE_CODES))
def test_a_close_while_registering_with_a_refusal_code_is_a_refusal(code: int) -> None:
    assert registering().closed(code, "no such token") == Refused(code, "no such token")
    assert registering().closed(code) == Refused(code, "closed by the server")


@pytest.mark.parametrize("code", [CloseCode.GOING_AWAY, CloseCode.REPLACED, CloseCode.HEARTBEAT_TIMEOUT, 1006, None])
def test_other_closes_are_a_lost_link_not_a_refusal(code: int | None) -> None:
    assert registering().closed(code, "bye") is None
    session = opened()
    assert session.closed(CloseCode.UNAUTHORIZED, "revoked") is None  # after the ACK: not a refusal of this one


def test_a_bad_answer_to_the_register_is_a_bad_frame() -> None:
    cases = [
        ("not json", "not_json", True),
        (server(ServerMessageType.COMMAND, **COMMAND), "not_register_ack", False),  # a COMMAND before the ACK
        (server(ServerMessageType.HEARTBEAT), "not_register_ack", False),
        (server(ServerMessageType.REGISTER_ACK, payload={"device": "laptop"}), "invalid", False),
    ]
    for text, reason, frame_error in cases:
        session = registering()
        verdict = session.receive(text)
        assert isinstance(verdict, BadFrame) and (verdict.reason, verdict.frame_error) == (reason, frame_error), text
        assert session.state is DeviceSessionState.REGISTERING and session.ack is None
    verdict = registering().receive(server(ServerMessageType.COMMAND, **COMMAND))
    assert isinstance(verdict, BadFrame) and verdict.error == "expected register_ack, the server sent command"


def test_each_server_message_is_its_event() -> None:
    session = opened()
    rid = "r-1"
    calls = [{"call_id": "c1", "response_id": "r0"}, {"call_id": "c2"}]
    cases: list[tuple[str, object]] = [
        (SERVER_HEARTBEAT % ("2026-01-01T00:00:00+00:00", "abc"), HeartbeatAck()),  # the template
        (server(ServerMessageType.HEARTBEAT, payload={"x": 1}), HeartbeatAck()),  # any other heartbeat
        (server(ServerMessageType.CANCEL, response_id=rid), CancelArrived(rid)),
        (server(ServerMessageType.DEVICE_INFO_REQUEST, response_id=rid), ProfileRequested(rid)),
        (server(ServerMessageType.ELICITATION_ANSWER, payload={"id": "q", "action": "accept"}),
         ElicitationAnswer({"id": "q", "action": "accept"})),
        (server(ServerMessageType.ERROR, error="bad result"), ServerReportedError("bad result")),
        (server(ServerMessageType.REGISTER_ACK, payload=ACK.model_dump()), Unexpected(ServerMessageType.REGISTER_ACK)),
    ]
    for text, expected in cases:
        assert session.receive(text) == expected, text
    batch = session.receive(server(ServerMessageType.COMMAND, response_id=rid, **COMMAND))
    assert isinstance(batch, CommandsArrived) and batch.batch.response_id == rid
    assert batch.batch.actions is not None and batch.batch.actions[0].call_id == "c1"
    for kind, payload in ((ServerMessageType.POLICY_REQUEST, None),
                          (ServerMessageType.POLICY_SET, {"policy": {}, "replace": True})):
        policy = session.receive(server(kind, response_id=rid, payload=payload))
        assert isinstance(policy, PolicyRequest) and policy.message.type is kind
    query = session.receive(server(ServerMessageType.OUTCOME_QUERY, response_id=rid, payload={"calls": calls}))
    assert isinstance(query, OutcomeQuery) and query.response_id == rid
    assert [(c.call_id, c.response_id) for c in query.calls] == [("c1", "r0"), ("c2", None)]
    reply = session.receive(server(ServerMessageType.SAMPLING_REPLY, response_id=rid, payload={"text": "hi"}))
    assert isinstance(reply, SamplingReply) and reply.message.payload == {"text": "hi"}
    assert session.state is DeviceSessionState.OPEN


def test_garbage_is_a_bad_frame_and_the_session_stays_open() -> None:
    session = opened()
    cases = [
        ("not json", "not_json"),
        ('{"type": "command"}', "invalid"),  # a COMMAND without actions
        ('{"type": "outcome_query", "payload": {"calls": []}}', "invalid"),  # a query about nothing
        (json.dumps({"type": "heartbeat", "protocol_version": "9.0"}), "version"),
        (server(ServerMessageType.ERROR, error="x" * 5000), "too_large"),  # over the ACK's limit
        ('{"type": "heartbeat", "payload": {"n": NaN}}', "not_json"),
    ]
    for text, reason in cases:
        event = session.receive(text)
        assert isinstance(event, BadFrame) and event.frame_error and event.reason == reason, (text[:80], event)
    assert session.state is DeviceSessionState.OPEN
    assert isinstance(session.receive(server(ServerMessageType.HEARTBEAT)), HeartbeatAck)


def test_calls_out_of_order_are_the_callers_bug() -> None:
    session = DeviceSession(None, "i-1")
    with pytest.raises(RuntimeError):
        session.receive(server(ServerMessageType.HEARTBEAT))  # nothing sent yet
    with pytest.raises(RuntimeError):
        session.receive_open(server(ServerMessageType.HEARTBEAT))
    session.register(DeviceProfile(), [])
    with pytest.raises(RuntimeError):
        session.register(DeviceProfile(), [])
    with pytest.raises(RuntimeError):
        session.receive_open(server(ServerMessageType.HEARTBEAT))  # not open before the ACK
    opened_session = opened()
    with pytest.raises(RuntimeError):
        opened_session.registration_reply(server(ServerMessageType.REGISTER_ACK, payload=ACK.model_dump()))


def test_the_error_frame_names_the_device() -> None:
    msg = decode_client_message(opened().error_frame("not_json: frame is not valid JSON"))
    assert (msg.type, msg.client_id, msg.error) == (ClientMessageType.ERROR, "laptop",
                                                    "not_json: frame is not valid JSON")
