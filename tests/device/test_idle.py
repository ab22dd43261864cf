"""What an idle device, and a device whose server is down, costs (issue 13): the cheap paths must say
exactly what the slow ones said.

The heartbeat is written from a template: checked against the real encoder for any client_id, and
against the real server, which must take the device's load from it. The server's heartbeat reply is
recognised without a model: checked against the server's own template, and every frame it recognises
must be one the full decoder accepts the same way. A device retrying a closed port logs the first
failure, then one line a minute, then its recovery. The proxy is decided once, from the same
environment variables as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.device.test_connection import TOKEN, ScriptedServer
from tests.kits.aip import WAIT, ServerFactory
from tether.device.link import settings as link_settings
from tether.device.link.connection import DeviceConnection, LinkHooks, LinkSettings, RetriesExhausted
from tether.device.link.reconnect import FailureLog
from tether.device.local import LocalDevice, build_device
from tether.protocol.codec import (
    FrameError,
    HeartbeatFrame,
    decode_client_message,
    decode_server_message,
    encode,
    is_server_heartbeat,
)
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessage, ServerMessageType, TaskStatus
from tether.protocol.models import Command, new_call_id
from tether.protocol.profile import DeviceProfile
from tether.protocol.wire import SERVER_HEARTBEAT
from tether.tools.policy.model import default_policy

LOGGER = "tether.device.link.connection"


# ------------------------------------------------------------------ the heartbeat frame


def _encoded(client_id: str | None, running: int, queued: int, timestamp: str) -> str:
    return encode(ClientMessage(type=ClientMessageType.HEARTBEAT, client_id=client_id, timestamp=timestamp,
                                payload={"running": running, "queued": queued}))


@pytest.mark.parametrize("client_id", [None, "dev-1", 'quote"back\\slash', "tab\tnew\nline\x00", "é 名前 \u2028 😀",
                                       "%s %d {} {0}", "x" * 300, "7000000000000000001"])
def test_the_heartbeat_template_is_the_encoders_frame(client_id: str | None) -> None:
    beat = HeartbeatFrame(client_id)
    for running, queued in ((0, 0), (3, 1), (10**12, 10**12)):
        frame = beat(running, queued)
        timestamp = json.loads(frame)["timestamp"]
        assert frame == _encoded(client_id, running, queued, timestamp)
        msg = decode_client_message(frame)
        assert (msg.type, msg.client_id, msg.payload) == (ClientMessageType.HEARTBEAT, client_id,
                                                          {"running": running, "queued": queued})
        assert datetime.fromisoformat(timestamp).tzinfo is not None


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.text()), st.integers(0, 2**40), st.integers(0, 2**40))
def test_the_heartbeat_template_matches_the_encoder_for_any_name(client_id: str | None, running: int,
                                                                 queued: int) -> None:
    frame = HeartbeatFrame(client_id)(running, queued)
    assert frame == _encoded(client_id, running, queued, json.loads(frame)["timestamp"])


# ------------------------------------------------------------------ the server's heartbeat reply


def _server_heartbeat() -> str:
    return SERVER_HEARTBEAT % (datetime.now(UTC).isoformat(), new_call_id())  # what DeviceLink.heartbeat sends


def test_the_servers_heartbeat_reply_is_recognised_as_the_decoder_reads_it() -> None:
    frame = _server_heartbeat()
    assert is_server_heartbeat(frame)
    msg = decode_server_message(frame)
    assert (msg.type, msg.status) == (ServerMessageType.HEARTBEAT, TaskStatus.OK)


def test_anything_else_goes_to_the_full_decoder() -> None:
    frame = _server_heartbeat()
    others = [
        encode(ServerMessage(type=ServerMessageType.HEARTBEAT)),  # a valid heartbeat of another shape
        frame.encode(),  # bytes
        frame + " ", " " + frame,
        frame.replace('"ok"', '"error"'),
        frame.replace('"heartbeat"', '"command"'),
        frame.replace('"early_exit":true', '"early_exit":false'),
        frame.replace('"timestamp":"', '"timestamp":"\\u0041'),  # escapes: left to the decoder
        frame.replace('"timestamp":"', '"timestamp":"\x01'),  # a raw control character: not JSON
        frame.replace('"timestamp":"', '"timestamp":"é'),
        frame[:-1] + ',"payload":{}}',
        frame[:-1] + ',"extra":1}',  # the decoder refuses unknown fields
        frame.replace('"protocol_version":"1.0"', '"protocol_version":"2.0"'),
        frame.replace('"protocol_version":"1.0"', '"protocol_version":"1.1"'),
    ]
    for other in others:
        assert not is_server_heartbeat(other), other
    with pytest.raises(FrameError) as info:
        decode_server_message(others[-3])
    assert info.value.reason == "invalid"
    with pytest.raises(FrameError) as info:
        decode_server_message(others[-2])
    assert info.value.reason == "version"
    # the frame-size cap holds for the recognised shape too
    assert not is_server_heartbeat(frame, max_bytes=len(frame) - 1)
    with pytest.raises(FrameError) as info:
        decode_server_message(frame, len(frame) - 1)
    assert info.value.reason == "too_large"


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_a_recognised_frame_is_always_one_the_decoder_accepts_as_that_heartbeat(data: st.DataObject) -> None:
    frame = _server_heartbeat()
    at = data.draw(st.integers(0, len(frame)))
    cut = data.draw(st.integers(0, 3))
    piece = data.draw(st.text(max_size=4))
    mutated = frame[:at] + piece + frame[at + cut:]
    if is_server_heartbeat(mutated):
        msg = decode_server_message(mutated)
        assert (msg.type, msg.status, msg.early_exit) == (ServerMessageType.HEARTBEAT, TaskStatus.OK, True)


# ------------------------------------------------------------------ the log of a long outage


class Clock:
    """The failure log's clock, moved by the test: the log's policy is about minutes, not the test's time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    caplog.clear()
    return lines


def test_failures_in_a_row_warn_once_then_once_a_minute_then_say_when_they_end(caplog) -> None:
    log = logging.getLogger("tether.test.failures")
    clock = Clock()
    failures = FailureLog(log, every=60.0, clock=clock)
    url = "ws://example.test/aip"
    with caplog.at_level(logging.DEBUG, logger=log.name):
        failures.failed(url, "refused")
        assert _lines(caplog) == [("WARNING", f"cannot connect to {url}: refused")]
        for _ in range(5):
            clock.now += 10
            failures.failed(url, "refused")
        assert _lines(caplog) == [("DEBUG", f"cannot connect to {url}: refused")] * 5
        clock.now += 10  # 60 s after the last warning
        failures.failed(url, "refused")
        assert _lines(caplog) == [("WARNING", f"still cannot connect to {url} after 7 attempts in 60s: refused")]
        clock.now += 1
        failures.failed(url, "timed out")  # a new failure is said at once
        assert _lines(caplog) == [("WARNING", f"cannot connect to {url}: timed out")]
        clock.now += 1
        failures.failed(url, "refused")  # seen in this outage already
        assert _lines(caplog) == [("DEBUG", f"cannot connect to {url}: refused")]
        clock.now += 4.5
        failures.succeeded(url)
        assert _lines(caplog) == [("WARNING", f"reconnected to {url} after 9 failed attempt(s) in 66.5s")]
        failures.succeeded(url)  # a success without failures before it says nothing here
        assert _lines(caplog) == []
        failures.failed(url, "refused")  # a new outage starts over
        assert _lines(caplog) == [("WARNING", f"cannot connect to {url}: refused")]


def test_failures_whose_words_always_change_are_not_all_warned(caplog) -> None:
    log = logging.getLogger("tether.test.failures")
    failures = FailureLog(log, every=60.0, clock=Clock())
    with caplog.at_level(logging.DEBUG, logger=log.name):
        for n in range(100):
            failures.failed("ws://a/aip", f"no answer within {n}s")
    levels = [r.levelname for r in caplog.records]
    assert levels.count("WARNING") == 16 and levels.count("DEBUG") == 84


def _device(tmp_path: Path) -> LocalDevice:
    roots = [str(tmp_path)]
    policy = default_policy().model_copy(update={"read_roots": roots, "write_roots": roots})
    return build_device(policy=policy, state_dir=tmp_path / "state", sandbox=False)


async def test_a_closed_port_is_warned_about_once_and_every_attempt_still_counts(tmp_path: Path, free_port: int,
                                                                                caplog) -> None:
    device = _device(tmp_path)
    errors: list[str | None] = []

    def on_state(state: str, conn: DeviceConnection) -> None:
        if state == "disconnected":
            errors.append(conn.last_error)

    url = f"ws://127.0.0.1:{free_port}/aip"
    conn = DeviceConnection(device.client, url, TOKEN, name="dev-1",
                            settings=LinkSettings(backoff_base=0.001, backoff_cap=0.002, max_attempts=6),
                            hooks=LinkHooks(on_state=on_state))
    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER), pytest.raises(RetriesExhausted, match="6 failed"):
            await asyncio.wait_for(conn.run(), WAIT)
    finally:
        await device.aclose()
    tried = [(r.levelname, r.getMessage()) for r in caplog.records if "connect to" in r.getMessage()]
    assert len(errors) == 6 and all(e and str(free_port) in e for e in errors)  # every attempt seen, as before
    assert tried == [("WARNING", f"cannot connect to {url}: {errors[0]}")] + [("DEBUG", f"cannot connect to {url}: "
                                                                                       f"{errors[0]}")] * 5
    assert conn.last_error == errors[-1]


async def test_the_recovery_after_failed_attempts_is_said_at_once(tmp_path: Path, free_port: int, caplog) -> None:
    device = _device(tmp_path)
    failed = asyncio.Queue[str | None]()

    def on_state(state: str, conn: DeviceConnection) -> None:
        if state == "disconnected":
            failed.put_nowait(conn.last_error)

    url = f"ws://127.0.0.1:{free_port}/aip"
    conn = DeviceConnection(device.client, url, TOKEN, name="dev-1",
                            settings=LinkSettings(backoff_base=0.001, backoff_cap=0.002),
                            hooks=LinkHooks(on_state=on_state))
    task = asyncio.create_task(conn.run())
    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            for _ in range(3):
                await asyncio.wait_for(failed.get(), WAIT)
            async with ScriptedServer(port=free_port) as server:  # the server is back on its port
                await asyncio.wait_for(server.registrations.get(), WAIT)
                await asyncio.wait_for(conn.connected.wait(), WAIT)
                attempts = 3 + failed.qsize()
                warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
                assert warnings[0].startswith(f"cannot connect to {url}: ")
                assert warnings[1:] == [warnings[1]] and warnings[1].startswith(
                    f"reconnected to {url} after {attempts} failed attempt(s) in ")
    finally:
        conn.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT)
        await device.aclose()


# ------------------------------------------------------------------ the proxy, decided once


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    return monkeypatch


async def test_the_proxy_environment_is_obeyed_as_before(tmp_path: Path, free_port: int,
                                                         no_proxy_env: pytest.MonkeyPatch) -> None:
    device = _device(tmp_path)
    try:
        async with ScriptedServer() as server:
            no_proxy_env.setenv("HTTPS_PROXY", f"http://127.0.0.1:{free_port}")  # nothing listens there
            through_proxy = DeviceConnection(device.client, server.url, TOKEN, name="dev-1",
                                             settings=LinkSettings(max_attempts=1))
            no_proxy_env.setenv("NO_PROXY", "127.0.0.1")  # decided already: this one still uses the proxy
            with pytest.raises(RetriesExhausted, match=str(free_port)):
                await asyncio.wait_for(through_proxy.run(), WAIT)
            assert server.registrations.empty()
            direct = DeviceConnection(device.client, server.url, TOKEN, name="dev-1",
                                      settings=LinkSettings(max_attempts=1))
            task = asyncio.create_task(direct.run())
            try:
                await asyncio.wait_for(direct.connected.wait(), WAIT)
                assert (await asyncio.wait_for(server.registrations.get(), WAIT)).name == "dev-1"
            finally:
                direct.stop()
                await asyncio.wait_for(task, WAIT)
    finally:
        await device.aclose()


# ------------------------------------------------------------------ against the real server


WAITER = """
import pathlib, sys
with open(pathlib.Path(sys.argv[1]) / "go", "rb") as go:  # a FIFO: blocks until the test writes to it
    go.read(2)
print("done", flush=True)
"""


async def test_the_real_server_takes_the_load_from_template_heartbeats_and_keeps_the_link(tmp_path: Path,
                                                                                            caplog) -> None:
    servers = ServerFactory(tmp_path)
    device = _device(tmp_path)
    # beats every 50 ms carry the load; the timeout is generous so that a loaded machine's scheduling stall is
    # not taken for a lost link (what is tested is that the beats, not commands, keep it and report the load)
    srv = await servers.start(heartbeat_interval=0.05, heartbeat_timeout=5.0)
    conn = DeviceConnection(device.client, srv.url, srv.token("beta"), name="beta")
    task = asyncio.create_task(conn.run())
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            await asyncio.wait_for(conn.connected.wait(), WAIT)
            record = srv.hub.registry.get("beta")
            (tmp_path / "waiter.py").write_text(WAITER)
            os.mkfifo(tmp_path / "go")
            # held open for reading and writing: the waiter's open never blocks, and what is written stays in
            # the pipe until it reads it, whenever it gets there
            go = os.open(tmp_path / "go", os.O_RDWR)
            waiter = Command(tool_name="shell.run", parameters={"cmd": "python3", "cwd": str(tmp_path),
                                                                "argv": [str(tmp_path / "waiter.py"), str(tmp_path)]})
            batch = asyncio.create_task(srv.hub.dispatcher("beta").execute_commands([waiter], 30))
            # only the device's heartbeats tell the server how many batches it runs
            assert await srv.hub.registry.wait_until(lambda: record.running == 1, WAIT)
            os.write(go, b"go")
            [result] = await asyncio.wait_for(batch, WAIT)
            os.close(go)
            assert result.status.value == "success", result
            assert await srv.hub.registry.wait_until(lambda: record.running == 0, WAIT)
        assert conn.connections == 1 and conn.state == "registered" and srv.hub.connected("beta")
        complaints = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert complaints == []  # no ERROR from the server, no lost link, no bad frame
    finally:
        conn.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT)
        await device.aclose()
        await servers.stop_all()


async def test_a_retrying_device_collects_its_profile_once_and_afresh_after_a_link(tmp_path: Path,
                                                                                  free_port: int) -> None:
    device = _device(tmp_path)
    collected: list[int] = []
    failed = asyncio.Queue[str | None]()

    async def profile() -> DeviceProfile:
        collected.append(len(collected))
        return DeviceProfile(tags=[f"collection-{len(collected)}"])

    def on_state(state: str, conn: DeviceConnection) -> None:
        if state == "disconnected":
            failed.put_nowait(conn.last_error)

    conn = DeviceConnection(device.client, f"ws://127.0.0.1:{free_port}/aip", TOKEN, name="dev-1", profile=profile,
                            settings=LinkSettings(backoff_base=0.001, backoff_cap=0.002, restart_spread=0.0),
                            hooks=LinkHooks(on_state=on_state))
    task = asyncio.create_task(conn.run())
    try:
        for _ in range(4):
            await asyncio.wait_for(failed.get(), WAIT)
        assert len(collected) == 1  # not once per attempt
        async with ScriptedServer(port=free_port) as server:
            first = await asyncio.wait_for(server.registrations.get(), WAIT)
            assert first.profile.tags == ["collection-1"]
            await asyncio.wait_for(conn.connected.wait(), WAIT)
            server.drop()
            again = await asyncio.wait_for(server.registrations.get(), WAIT)
            assert again.profile.tags == ["collection-2"]  # after a link that was up: a fresh one
    finally:
        conn.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT)
        await device.aclose()


# ------------------------------------------------------------------ the socket's own keepalive


async def test_keepalive_pings_flow_only_when_the_heartbeat_would_notice_silence_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    device = _device(tmp_path)
    try:
        monkeypatch.setattr(link_settings, "KEEPALIVE_S", 0.05)
        # a heartbeat timeout longer than a ping and its pong's wait: the socket's pings go on
        async with ScriptedServer(heartbeat_interval=1.0, heartbeat_timeout=5.0) as server:
            conn = DeviceConnection(device.client, server.url, TOKEN, name="dev-1")
            task = asyncio.create_task(conn.run())
            try:
                for _ in range(3):
                    assert await asyncio.wait_for(server.pings.get(), WAIT) == 1
            finally:
                conn.stop()
                await asyncio.wait_for(task, WAIT)
        monkeypatch.setattr(link_settings, "KEEPALIVE_S", 0.25)
        # within it: the heartbeat notices a silent server first, and the socket sends no pings
        async with ScriptedServer(heartbeat_interval=0.02, heartbeat_timeout=0.5) as server:
            conn = DeviceConnection(device.client, server.url, TOKEN, name="dev-1")
            task = asyncio.create_task(conn.run())
            try:
                for _ in range(60):  # 60 heartbeats 20 ms apart: about 5 keepalive intervals
                    await server.next(ClientMessageType.HEARTBEAT)
                assert conn.connections == 1
                assert server.pings.qsize() <= 1  # one sent before the ACK could be cancelled, at most
            finally:
                conn.stop()
                await asyncio.wait_for(task, WAIT)
    finally:
        await device.aclose()
