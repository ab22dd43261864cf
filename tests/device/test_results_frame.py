"""`results_frame` writes its JSON directly: it must be exactly what encoding the `ClientMessage` gives."""

from __future__ import annotations

import re

import pytest

from tether.device.link.outbox import results_frame
from tether.protocol.codec import decode_client_message, encode
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessage, ServerMessageType, TaskStatus
from tether.protocol.models import Command, Result, ResultStatus

STAMP = re.compile(r'"timestamp":"[^"]*"')


@pytest.mark.parametrize("client_id", [None, "laptop", 'q"uo\\te é 😀'])
@pytest.mark.parametrize("session_id", [None, "s-1", "ß\n"])
@pytest.mark.parametrize("result", [
    Result(status=ResultStatus.SUCCESS, result={}, namespace="bench", call_id="c1"),
    Result(status=ResultStatus.SUCCESS, result={"a": None, "b": [None, {"c": "é\u2028"}], "n": 1e300}, call_id="c2"),
    Result.failure("it broke: \"quoted\"\n", "c3", "shell", result={"exit_code": 2}),
    Result(status=ResultStatus.SKIPPED, error="skipped"),
])
@pytest.mark.parametrize("last", [True, False])
def test_the_frame_is_the_encoded_message(client_id: str | None, session_id: str | None, result: Result,
                                          last: bool) -> None:
    msg = ServerMessage(type=ServerMessageType.COMMAND, actions=[Command(tool_name="noop")], session_id=session_id)
    text = results_frame(msg, result, last=last, client_id=client_id, max_bytes=1 << 20)
    expected = encode(ClientMessage(type=ClientMessageType.COMMAND_RESULTS, client_id=client_id, session_id=session_id,
                                    prev_response_id=msg.response_id, action_results=[result],
                                    status=TaskStatus.COMPLETED if last else TaskStatus.CONTINUE))
    assert STAMP.sub("", text) == STAMP.sub("", expected)
    decoded = decode_client_message(text)
    assert decoded.action_results == [result] and decoded.timestamp


def test_an_empty_response_id_is_still_refused() -> None:
    msg = ServerMessage(type=ServerMessageType.COMMAND, actions=[Command(tool_name="noop")], response_id="")
    with pytest.raises(ValueError, match="prev_response_id"):
        results_frame(msg, Result(status=ResultStatus.SUCCESS), last=True, client_id=None, max_bytes=1 << 20)
