"""Fuzzing AIP: the codec, the server's /aip socket before and after registration, the device's link.

Every frame the fuzzer sends goes over a real WebSocket on 127.0.0.1. The oracle is the protocol's
own rules, computed with the codec beside the test: a frame the codec refuses gets exactly one
ERROR reply naming the same reason; a bad first frame gets REGISTER_REFUSED and a close with one
of the documented codes; a frame over the transport's limit closes the socket with 1009. After
every example the peer that was fuzzed still answers on the same connection, a well-behaved
device still registers and runs a command through the REST API, and no handler logged an error.
Nothing waits on a sleep: each wait is a frame, bounded by WAIT.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from tests.kits.aip import registration as proven_registration
from tests.kits.frames import (
    SAFE_TOOLS,
    Frame,
    as_text,
    client_dicts,
    frames,
    json_values,
    new_id,
    registration,
    server_dicts,
    wire_size,
)
from tests.kits.fuzz import WAIT, ErrorLog, LiveServer, fuzz_settings
from tether.device.link.connection import DeviceConnection, LinkSettings
from tether.device.local import LocalDevice, build_device
from tether.protocol.codec import FrameError, decode_client_message, decode_server_message, encode
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
from tether.protocol.models import Command, Result, ResultStatus
from tether.protocol.profile import DeviceProfile
from tether.protocol.wire import CloseCode
from tether.tools.policy.model import default_policy

LIMIT = 16 * 1024  # the server's max_frame_bytes here (LiveServer) and the scripted server's ACK
CLOSE_TOO_BIG = 1009  # RFC 6455: the transport's own limit (twice the protocol's) was passed

# -- well-formed frames -----------------------------------------------------------------------------

good_client = st.one_of(
    st.builds(lambda n: encode(ClientMessage(type=ClientMessageType.HEARTBEAT, payload={"running": n})),
              st.integers(-3, 5) | json_values),
    st.builds(lambda e: encode(ClientMessage(type=ClientMessageType.EVENT, payload=e)),
              st.builds(lambda k, r: Event(kind=k, response_id=r).model_dump(), st.text(max_size=8),
                        st.none() | st.text(max_size=8))),
    st.builds(lambda r, s, rs: encode(ClientMessage(type=ClientMessageType.COMMAND_RESULTS, prev_response_id=r,
                                                    status=s, action_results=rs)),
              st.text(min_size=1, max_size=8), st.sampled_from(list(TaskStatus)),
              st.lists(st.builds(Result, status=st.sampled_from(list(ResultStatus)),
                                 call_id=st.none() | st.text(max_size=8)), max_size=3)),
    st.builds(lambda tags: encode(ClientMessage(type=ClientMessageType.DEVICE_INFO,
                                                payload=DeviceProfile(tags=tags).model_dump(mode="json"))),
              st.lists(st.text(max_size=8), max_size=3)),
    st.builds(lambda e, r: encode(ClientMessage(type=ClientMessageType.ERROR, error=e, prev_response_id=r)),
              st.none() | st.text(max_size=20), st.none() | st.text(max_size=8)),
    registration.map(lambda p: json.dumps({"type": "register", "payload": p})),
)

good_server = st.one_of(
    st.lists(st.builds(Command, tool_name=st.sampled_from(SAFE_TOOLS[:4]),
                       parameters=st.none() | st.fixed_dictionaries({"path": st.sampled_from([".", "/nope"])})),
             min_size=1, max_size=3)
    .flatmap(lambda cs: st.builds(lambda ee: encode(ServerMessage(type=ServerMessageType.COMMAND, actions=cs,
                                                                  early_exit=ee, timeout=WAIT)), st.booleans())),
    st.builds(lambda r: encode(ServerMessage(type=ServerMessageType.CANCEL, response_id=r)), st.text(max_size=8)),
    st.just(encode(ServerMessage(type=ServerMessageType.HEARTBEAT))),
    st.builds(lambda e: encode(ServerMessage(type=ServerMessageType.ERROR, error=e)), st.none() | st.text(max_size=20)),
    st.builds(lambda p: encode(ServerMessage(type=ServerMessageType.REGISTER_ACK, payload=p)),
              st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
    st.builds(lambda e: json.dumps({"type": "register_refused", "error": e}), st.text(min_size=1, max_size=20)),
)

client_frames = frames(client_dicts, good_client, "heartbeat", LIMIT)
server_frames = frames(server_dicts, good_server, "error", LIMIT)


def run(runner: asyncio.Runner, coro: Any, bound: float = 4 * WAIT) -> Any:
    """One example's client side, on the module's loop; a hang is a failure, not a stuck suite."""
    async def bounded() -> Any:
        async with asyncio.timeout(bound):
            return await coro

    return runner.run(bounded())


# == the codec ====================================================================================


@given(data=st.one_of(st.text(), st.binary(), client_frames.map(lambda f: f[1]), server_frames.map(lambda f: f[1])),
       limit=st.sampled_from([1, 64, LIMIT, 1 << 30]))
@fuzz_settings(scale=5)
@example(data='{"type":"heartbeat","protocol_version":"2.0"}', limit=LIMIT)
@example(data='{"type":"command","protocol_version":"1.0","actions":[],"timeout":1e999}', limit=LIMIT)
@example(data=b'\xff\xfe{"type":"heartbeat"}', limit=LIMIT)
@example(data='{"type":"heartbeat","protocol_version":1}', limit=LIMIT)
@example(data='{"type":"heartbeat","protocol_version":"\\ud800"}', limit=LIMIT)
@example(data='[1,2]', limit=LIMIT)
@example(data='{"type":"register","payload":{"x":[Infinity]}}', limit=LIMIT)
@example(data=b'{"type":"heartbeat","payload":{"n":NaN}}', limit=LIMIT)
@example(data='{"type":"error","error":"NaN and Infinity in a string are fine"}', limit=LIMIT)
def test_the_decoder_accepts_or_raises_frame_error_only(data: str | bytes, limit: int) -> None:
    for decode in (decode_client_message, decode_server_message):
        try:
            message = decode(data, limit)
        except FrameError as exc:
            assert exc.reason in ("too_large", "not_json", "invalid", "version"), exc.reason
            assert str(exc)
            continue
        # what was accepted is JSON (strictly: no NaN or Infinity), a message of this side and of this
        # major version, and it re-encodes to a frame that decodes to the same message
        json.loads(data, parse_constant=not_json)
        assert message.protocol_version.split(".")[0] == PROTOCOL_VERSION.split(".")[0]
        again = decode(encode(message), 1 << 30)
        assert json.loads(encode(again)) == json.loads(encode(message))  # a number too large for a float
        # (1e999) is read as inf and written as null, once: after that the frame is stable
        if not overflows(data):
            assert again == message


def not_json(constant: str) -> None:
    raise AssertionError(f"the decoder accepted {constant}, which is not JSON")


def overflows(data: str | bytes) -> bool:
    def walk(value: Any) -> bool:
        if isinstance(value, float):
            return value != value or value in (float("inf"), float("-inf"))
        if isinstance(value, list):
            return any(walk(v) for v in value)
        if isinstance(value, dict):
            return any(walk(v) for v in value.values())
        return False

    return walk(json.loads(data))


@given(message=st.one_of(
    client_dicts.map(lambda d: ("client", d)), server_dicts.map(lambda d: ("server", d))))
@fuzz_settings(scale=3)
def test_what_the_codec_accepts_round_trips(message: tuple[str, dict[str, Any]]) -> None:
    side, data = message
    decode = decode_client_message if side == "client" else decode_server_message
    try:
        decoded = decode(json.dumps(data), 1 << 30)
    except FrameError:
        return
    assert decode(encode(decoded), 1 << 30) == decoded


# == the server's /aip socket ======================================================================


async def open_socket(server: LiveServer, device: str) -> ClientConnection:
    return await connect(server.aip, additional_headers=server.auth(server.device_tokens[device]),
                         ping_interval=None, max_size=None, open_timeout=WAIT, close_timeout=WAIT)


async def send(ws: ClientConnection, frame: Frame) -> None:
    await ws.send(frame[1], text=not frame[0])


async def next_frame(ws: ClientConnection) -> ServerMessage:
    async with asyncio.timeout(WAIT):
        raw = await ws.recv()
    return decode_server_message(raw, 1 << 30)


async def close_code(ws: ClientConnection) -> int:
    """The code the server closed the socket with (reading and discarding anything before it)."""
    try:
        async with asyncio.timeout(WAIT):
            while True:
                await ws.recv()
    except ConnectionClosed as exc:
        assert exc.rcvd is not None, f"closed without a close frame: {exc}"
        return exc.rcvd.code


async def register(ws: ClientConnection, name: str, instance_id: str = "fuzz-instance") -> ServerMessage:
    reg = proven_registration(ws, name, instance_id)
    await ws.send(encode(ClientMessage(type=ClientMessageType.REGISTER, payload=reg.model_dump())))
    return await next_frame(ws)


async def a_good_device_still_works(server: LiveServer) -> None:
    """A well-behaved device registers and runs a command sent through the REST API; the server
    logged no error while the example ran."""
    ws = await open_socket(server, "good")
    try:
        ack = await register(ws, "good", "good-instance")  # the same instance: it replaces the last one
        assert ack.type is ServerMessageType.REGISTER_ACK, ack

        async def answer() -> None:
            while True:
                msg = await next_frame(ws)
                if msg.type is ServerMessageType.COMMAND:
                    await ws.send(encode(ClientMessage(
                        type=ClientMessageType.COMMAND_RESULTS, prev_response_id=msg.response_id,
                        status=TaskStatus.COMPLETED, action_results=[
                            Result(status=ResultStatus.SUCCESS, result="pong", call_id=c.call_id)
                            for c in msg.actions or []])))

        answering = asyncio.create_task(answer())
        try:
            async with httpx.AsyncClient(base_url=server.base, timeout=WAIT) as http:
                response = await http.post("/api/v1/devices/good/commands", headers=server.auth(),
                                           json={"commands": [{"tool_name": "ping"}], "timeout": WAIT})
        finally:
            answering.cancel()
        assert response.status_code == 200, response.text
        assert [r["result"] for r in response.json()["results"]] == ["pong"]
    finally:
        await ws.close()
    assert server.alive
    assert not (errors := server.errors.take()), "\n".join(errors)


def first_frame_verdict(frame: Frame) -> tuple[str, int | None]:
    """What the server must answer to `frame` as the first one: ("ack", None) or ("refused", code)
    or ("closed", 1009). Mirrors the protocol's rules, with the codec beside the test."""
    if wire_size(frame) > 2 * LIMIT:
        return "closed", CLOSE_TOO_BIG
    try:
        msg = decode_client_message(as_text(frame), LIMIT)
        if msg.type is not ClientMessageType.REGISTER:
            return "refused", CloseCode.BAD_REGISTRATION
        reg = Registration.model_validate(msg.payload)
    except (FrameError, ValidationError):
        return "refused", CloseCode.BAD_REGISTRATION
    if reg.name is not None and reg.name != "fuzz-pre":
        return "refused", CloseCode.WRONG_DEVICE
    # a well-formed registration still has to sign this connection's challenge with the device's key, which
    # no generated frame can (issue 27): a device token alone registers nothing
    return "refused", CloseCode.KEY_REFUSED


@given(frame=client_frames)
@fuzz_settings(scale=1)
@example(frame=(False, '{"type":"heartbeat","payload":{"running":1}}'))
@example(frame=(False, '{"type":"register","payload":{"instance_id":"fuzz-instance","name":"fuzz-pre"}}'))
@example(frame=(False, '{"type":"register","payload":{"instance_id":"fuzz-instance","name":"x"}}'))
@example(frame=(False, '{"type":"register","payload":{"instance_id":"","name":null}}'))
@example(frame=(False, '{"type":"register","protocol_version":"7.1","payload":{}}'))
@example(frame=(True, b"\x00\xff"))
def test_the_server_answers_any_first_frame_with_an_ack_or_a_documented_refusal(
        live_server: LiveServer, runner: asyncio.Runner, frame: Frame) -> None:
    verdict, code = first_frame_verdict(frame)

    async def scenario() -> None:
        ws = await open_socket(live_server, "fuzz-pre")
        try:
            await send(ws, frame)
            if verdict == "closed":
                assert await close_code(ws) == code
                return
            answer = await next_frame(ws)
            if verdict.startswith("ack") and answer.type is ServerMessageType.REGISTER_ACK:
                assert answer.payload and answer.payload["device"] == "fuzz-pre"
                # registered: the socket serves heartbeats
                await ws.send(encode(ClientMessage(type=ClientMessageType.HEARTBEAT, payload={"running": 0})))
                assert (await next_frame(ws)).type is ServerMessageType.HEARTBEAT
                return
            assert answer.type is ServerMessageType.REGISTER_REFUSED, answer
            assert answer.error
            got = await close_code(ws)
            if verdict == "ack-or-duplicate":  # another instance id while the last one may still be live
                assert got == CloseCode.DUPLICATE, (got, answer.error)
            else:
                assert got == code, (got, answer.error)
        finally:
            await ws.close()
        await a_good_device_still_works(live_server)

    run(runner, scenario())


def reply_verdict(frame: Frame) -> tuple[str, str | None]:
    """What a registered device's frame must get: ("error", reason), ("heartbeat", None), ("none", None)
    or ("closed", None) for one over the transport's limit."""
    if wire_size(frame) > 2 * LIMIT:
        return "closed", None
    try:
        msg = decode_client_message(as_text(frame), LIMIT)
    except FrameError as exc:
        return "error", exc.reason
    kind = msg.type
    if kind is ClientMessageType.REGISTER:
        return "error", "unexpected"
    if kind is ClientMessageType.HEARTBEAT:
        return "heartbeat", None
    try:
        if kind is ClientMessageType.EVENT:
            Event.model_validate(msg.payload)
        elif kind is ClientMessageType.DEVICE_INFO:
            DeviceProfile.model_validate(msg.payload or {})
    except ValidationError:
        return "error", "invalid"
    return "none", None


@given(batch=st.lists(client_frames, min_size=1, max_size=4))
@fuzz_settings(scale=1)
@example(batch=[(False, "not json"), (False, '{"type":"register","payload":{"instance_id":"x"}}'),
                (False, '{"type":"event","payload":{"kind":1}}'), (False, '{"type":"device_info","payload":[]}'),
                (False, '{"type":"command_results","prev_response_id":"nope","action_results":[]}'),
                (False, '{"type":"heartbeat","protocol_version":"9.0"}')])
def test_a_registered_device_gets_one_error_per_bad_frame_and_keeps_its_connection(
        live_server: LiveServer, runner: asyncio.Runner, batch: list[Frame]) -> None:
    async def scenario() -> None:
        ws = await open_socket(live_server, "fuzz-post")
        try:
            assert (await register(ws, "fuzz-post")).type is ServerMessageType.REGISTER_ACK
            for frame in batch:
                verdict, reason = reply_verdict(frame)
                await send(ws, frame)
                if verdict == "closed":
                    assert await close_code(ws) == CLOSE_TOO_BIG
                    return
                # a heartbeat round trip: the server handles a socket's frames in order, so every
                # answer to `frame` comes before the answer to this heartbeat
                await ws.send(encode(ClientMessage(type=ClientMessageType.HEARTBEAT, payload={"running": 0})))
                beats = 2 if verdict == "heartbeat" else 1
                answers: list[ServerMessage] = []
                while beats:
                    msg = await next_frame(ws)
                    if msg.type is ServerMessageType.HEARTBEAT:
                        beats -= 1
                    else:
                        answers.append(msg)
                if verdict == "error":
                    assert [(m.type, (m.payload or {}).get("reason")) for m in answers] == \
                        [(ServerMessageType.ERROR, reason)], (frame, answers)
                    assert answers[0].error
                else:
                    assert answers == [], (frame, answers)
        finally:
            await ws.close()
        await a_good_device_still_works(live_server)

    run(runner, scenario())


# == the device's link =============================================================================


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory, runner: asyncio.Runner):
    root = tmp_path_factory.mktemp("fuzz-device")
    policy = default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]})
    local = build_device(policy=policy, state_dir=root / "state", sandbox=False)
    yield local
    runner.run(local.aclose())


class ScriptedServer:
    """A few lines of `websockets` that play the server's side: the test scripts each connection."""

    def __init__(self) -> None:
        self.connections: asyncio.Queue[ServerConnection] = asyncio.Queue()
        self.done = asyncio.Event()

    async def handler(self, ws: ServerConnection) -> None:
        await self.connections.put(ws)
        await self.done.wait()

    async def next_connection(self) -> ServerConnection:
        async with asyncio.timeout(WAIT):
            ws = await self.connections.get()
            register = decode_client_message(await ws.recv(), 1 << 30)
        assert register.type is ClientMessageType.REGISTER
        return ws


ACK = RegisterAck(device="fuzzdev", heartbeat_interval=30, heartbeat_timeout=60, grace_period=5,
                  max_frame_bytes=LIMIT)


async def ack(ws: ServerConnection) -> None:
    await ws.send(encode(ServerMessage(type=ServerMessageType.REGISTER_ACK, status=TaskStatus.OK,
                                       payload=ACK.model_dump())))


async def from_device(ws: ServerConnection) -> ClientMessage:
    async with asyncio.timeout(WAIT):
        raw = await ws.recv()
    return decode_client_message(raw, 1 << 30)


async def device_sync(ws: ServerConnection) -> list[ClientMessage]:
    """Ask for the device's profile and return every frame that came before its answer (heartbeats
    left out). The device answers control frames (ERRORs, DEVICE_INFO) in the order it read their cause."""
    rid = new_id()
    await ws.send(encode(ServerMessage(type=ServerMessageType.DEVICE_INFO_REQUEST, response_id=rid)))
    seen: list[ClientMessage] = []
    while True:
        msg = await from_device(ws)
        if msg.type is ClientMessageType.DEVICE_INFO and msg.prev_response_id == rid:
            return seen
        if msg.type is not ClientMessageType.HEARTBEAT:
            seen.append(msg)


def device_verdict(frame: Frame) -> tuple[str, Any]:
    try:
        msg = decode_server_message(as_text(frame), LIMIT)
    except FrameError as exc:
        return "error", exc.reason
    if msg.type is ServerMessageType.COMMAND:
        return "command", msg
    if msg.type is ServerMessageType.DEVICE_INFO_REQUEST:
        return "device_info", msg.response_id
    return "none", None


async def run_device(device: LocalDevice, body: Any) -> DeviceConnection:
    """Start a scripted server and a `DeviceConnection` to it, run `body(server, conn)`, stop both."""
    scripted = ScriptedServer()
    async with serve(scripted.handler, "127.0.0.1", 0, max_size=None, ping_interval=None) as server:
        port = server.sockets[0].getsockname()[1]
        conn = DeviceConnection(device.client, f"ws://127.0.0.1:{port}/aip", "fuzz-token", name="fuzzdev",
                                settings=LinkSettings(backoff_base=0.001, backoff_cap=0.01, connect_timeout=WAIT))
        task = asyncio.create_task(conn.run())
        try:
            await body(scripted, conn)
        finally:
            conn.stop()
            scripted.done.set()
            async with asyncio.timeout(WAIT):
                await asyncio.gather(task, return_exceptions=True)
        assert task.exception() is None, task.exception()
    return conn


async def a_command_still_runs(ws: ServerConnection) -> None:
    rid = new_id()
    await ws.send(encode(ServerMessage(type=ServerMessageType.COMMAND, response_id=rid, timeout=WAIT,
                                       actions=[Command(tool_name="list_tools", call_id=new_id())])))
    while True:
        msg = await from_device(ws)
        if msg.type is ClientMessageType.COMMAND_RESULTS and msg.prev_response_id == rid:
            break
    assert msg.status is TaskStatus.COMPLETED
    [result] = msg.action_results or []
    assert result.status is ResultStatus.SUCCESS, result


@given(batch=st.lists(server_frames, min_size=1, max_size=4))
@fuzz_settings(scale=1)
@example(batch=[(False, "{"), (False, '{"type":"command","actions":[]}'), (False, '{"type":"cancel"}'),
                (False, '{"type":"command","actions":[{"tool_name":"list_tools","call_id":"a"},'
                        '{"tool_name":"list_tools","call_id":"a"}]}'),
                (False, '{"type":"register_ack","payload":{"max_frame_bytes":0}}')])
@example(batch=[(False, '{"type":"command","timeout":1e-300,"actions":[{"tool_name":"list_tools"}]}'),
                (False, '{"type":"command","actions":[{"tool_name":"list_tools","timeout":1e308}]}')])
def test_the_device_answers_every_bad_server_frame_with_an_error_and_keeps_working(
        device: LocalDevice, runner: asyncio.Runner, batch: list[Frame]) -> None:
    async def body(scripted: ScriptedServer, conn: DeviceConnection) -> None:
        ws = await scripted.next_connection()
        await ack(ws)
        owed = 0  # results the device owes: one per command of every batch (a batch without a
        # response_id gets one made up on each side, so results are counted, not matched by batch)
        for frame in batch:
            verdict, detail = device_verdict(frame)
            await send(ws, frame)  # type: ignore[arg-type]
            seen = await device_sync(ws)
            errors = [m for m in seen if m.type is ClientMessageType.ERROR]
            if verdict == "error":
                assert len(errors) == 1 and (errors[0].error or "").startswith(f"{detail}:"), (frame, seen)
            else:
                assert errors == [], (frame, seen)
            if verdict == "command":
                owed += len(detail.actions)
            owed -= sum(len(m.action_results or []) for m in seen if m.type is ClientMessageType.COMMAND_RESULTS)
        while owed > 0:
            msg = await from_device(ws)
            if msg.type is ClientMessageType.COMMAND_RESULTS:
                owed -= len(msg.action_results or [])
        assert owed == 0
        await a_command_still_runs(ws)
        assert conn.connections == 1 and conn.state == "registered", conn.last_error

    with device_logs_no_error():
        run(runner, run_device(device, body))


@given(frame=server_frames)
@fuzz_settings(scale=0.5)
@example(frame=(False, '{"type":"register_ack","payload":{}}'))
@example(frame=(False, '{"type":"register_refused","error":"no"}'))
@example(frame=(False, '{"type":"heartbeat"}'))
def test_the_device_survives_any_answer_to_its_registration(device: LocalDevice, runner: asyncio.Runner,
                                                            frame: Frame) -> None:
    """A bad answer to REGISTER costs the device that connection (it reconnects), never its life."""
    async def body(scripted: ScriptedServer, conn: DeviceConnection) -> None:
        ws = await scripted.next_connection()
        await send(ws, frame)  # type: ignore[arg-type]
        try:
            msg = decode_server_message(as_text(frame), 1 << 30)
            RegisterAck.model_validate(msg.payload or {})
            registered = msg.type is ServerMessageType.REGISTER_ACK
        except (FrameError, ValidationError):
            registered = False
        if not registered:
            await ws.close(1011 if frame[0] else 1000)
            ws = await scripted.next_connection()  # it came back
            await ack(ws)
        await a_command_still_runs(ws)
        assert conn.state == "registered"

    with device_logs_no_error():
        run(runner, run_device(device, body))


@contextlib.contextmanager
def device_logs_no_error() -> Iterator[None]:
    """Fails the example if the device logged anything at ERROR or above (a handler that raised)."""
    log = ErrorLog()
    logger = logging.getLogger("tether.device")
    logger.addHandler(log)
    try:
        yield
    finally:
        logger.removeHandler(log)
    assert not (logged := log.take()), "\n".join(logged)
