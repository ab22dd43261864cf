"""OUTCOME_QUERY / OUTCOME_REPORT on frames alone (issue 28, item 2): what the server may ask a device about
earlier calls, what the device may answer, and what the server's session makes of the answer."""

from __future__ import annotations

import json

import pytest

from tether.protocol.codec import FrameError, decode_client_message, decode_server_message, encode
from tether.protocol.messages import (
    CallOutcome,
    CallRef,
    ClientMessage,
    ClientMessageType,
    Registration,
    ServerMessage,
    ServerMessageType,
)
from tether.protocol.models import Result, ResultStatus
from tether.protocol.profile import DeviceProfile
from tether.protocol.server_session import BadFrame, OutcomesReported, ServerSession

LIMIT = 1 << 20


def query(*calls: CallRef) -> ServerMessage:
    return ServerMessage(type=ServerMessageType.OUTCOME_QUERY,
                         payload={"calls": [c.model_dump(exclude_none=True) for c in calls]})


def test_a_query_names_calls_and_round_trips() -> None:
    sent = query(CallRef(call_id="c1", response_id="r1"), CallRef(call_id="c2"))
    back = decode_server_message(encode(sent))
    assert back.type is ServerMessageType.OUTCOME_QUERY and back.response_id == sent.response_id
    assert [CallRef.model_validate(c) for c in (back.payload or {})["calls"]] == [
        CallRef(call_id="c1", response_id="r1"), CallRef(call_id="c2")]
    assert not back.actions  # it carries nothing to run


@pytest.mark.parametrize("payload", [None, {}, {"calls": []}, {"calls": [{"response_id": "r1"}]},
                                     {"calls": [{"call_id": ""}]}, {"calls": [{"call_id": "c", "run": True}]}])
def test_a_query_without_calls_to_name_is_refused(payload: object) -> None:
    frame = json.dumps({"type": "outcome_query", "protocol_version": "1.0", "timestamp": "t", "payload": payload})
    with pytest.raises(FrameError) as err:
        decode_server_message(frame)
    assert err.value.reason == "invalid"


def test_an_outcome_is_finished_with_its_result_or_running_or_unknown() -> None:
    done = Result(status=ResultStatus.SUCCESS, result={"stdout": "hi"}, call_id="c1")
    assert CallOutcome(call_id="c1", state="finished", response_id="r1", result=done).result == done
    assert CallOutcome(call_id="c2", state="running").result is None
    assert CallOutcome(call_id="c3", state="unknown", note="no record").note == "no record"
    with pytest.raises(ValueError, match="finished call carries its result"):
        CallOutcome(call_id="c1", state="finished")
    with pytest.raises(ValueError, match="finished call carries its result"):
        CallOutcome(call_id="c1", state="running", result=done)
    with pytest.raises(ValueError):
        CallOutcome(call_id="c1", state="ran twice")  # type: ignore[arg-type]


def report(prev: str | None, outcomes: object) -> str:
    return json.dumps({"type": "outcome_report", "protocol_version": "1.0", "timestamp": "t",
                       "prev_response_id": prev, "payload": {"outcomes": outcomes}})


def test_a_report_answers_its_query_with_valid_outcomes() -> None:
    done = CallOutcome(call_id="c1", state="finished", response_id="r1",
                       result=Result(status=ResultStatus.FAILURE, error="exit 3", call_id="c1"))
    msg = decode_client_message(encode(ClientMessage(type=ClientMessageType.OUTCOME_REPORT, prev_response_id="q1",
                                                     payload={"outcomes": [done.model_dump(mode="json")]})))
    assert CallOutcome.model_validate((msg.payload or {})["outcomes"][0]) == done
    with pytest.raises(FrameError):
        decode_client_message(report(None, []))  # answers nothing
    with pytest.raises(FrameError):
        decode_client_message(report("q1", [{"call_id": "c1", "state": "finished"}]))  # finished, no result
    with pytest.raises(FrameError):
        decode_client_message(json.dumps({"type": "outcome_report", "protocol_version": "1.0", "timestamp": "t",
                                          "prev_response_id": "q1", "payload": {}}))


def opened() -> ServerSession:
    session = ServerSession("laptop", LIMIT)
    reg = Registration(name="laptop", instance_id="i-1", profile=DeviceProfile())
    first = encode(ClientMessage(type=ClientMessageType.REGISTER, payload=reg.model_dump()))
    assert isinstance(session.register(first), Registration)
    session.open()
    return session


def test_the_servers_session_hands_a_report_to_whoever_asked() -> None:
    session = opened()
    event = session.receive(report("q1", [{"call_id": "c1", "state": "running", "response_id": "r1"}]))
    assert isinstance(event, OutcomesReported) and event.message.prev_response_id == "q1"
    bad = session.receive(report("q1", [{"call_id": "c1", "state": "finished"}]))
    assert isinstance(bad, BadFrame) and bad.reason == "invalid"
