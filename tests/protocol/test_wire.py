"""AIP's wire constants (`tether.protocol.wire`): the close codes' values are the protocol's and never move,
and the server's hand-written heartbeat reply is a valid frame that the device's fast check recognises."""

from __future__ import annotations

from datetime import UTC, datetime

from tether.protocol.codec import decode_server_message, is_server_heartbeat
from tether.protocol.messages import ServerMessageType, TaskStatus
from tether.protocol.models import new_call_id
from tether.protocol.wire import SERVER_HEARTBEAT, CloseCode


def test_close_code_values_are_the_protocols() -> None:
    assert {code.name: int(code) for code in CloseCode} == {
        "GOING_AWAY": 1001,
        "REPLACED": 4000,
        "HEARTBEAT_TIMEOUT": 4001,
        "BAD_REGISTRATION": 4400,
        "UNAUTHORIZED": 4401,
        "KEY_REFUSED": 4402,
        "WRONG_DEVICE": 4403,
        "DUPLICATE": 4409,
    }
    assert f"{CloseCode.DUPLICATE}" == "4409" and CloseCode.DUPLICATE == 4409


def test_the_server_heartbeat_is_a_valid_frame_the_device_recognises() -> None:
    frame = SERVER_HEARTBEAT % (datetime.now(UTC).isoformat(), new_call_id())
    message = decode_server_message(frame)
    assert message.type is ServerMessageType.HEARTBEAT and message.status is TaskStatus.OK and message.early_exit
    assert is_server_heartbeat(frame)
    assert not is_server_heartbeat(frame.replace('"early_exit":true', '"early_exit":false'))
