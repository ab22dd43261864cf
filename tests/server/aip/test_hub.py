"""The agent server's AIP endpoint over a real socket: registration, refusals, bad frames, liveness.

A real uvicorn server on 127.0.0.1 and a scripted device speaking raw `websockets` (aip_testkit).
Batches, results and reconnection are in test_server_dispatch.py.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from websockets.exceptions import InvalidStatus

from tests.kits import db as dbkit
from tests.kits.aip import WAIT, FakeDevice, ServerFactory
from tether.protocol.messages import ClientMessage, ClientMessageType, ServerMessageType
from tether.protocol.models import Command, ResultStatus
from tether.protocol.profile import DeviceProfile
from tether.protocol.wire import CloseCode
from tether.server.store import Store


@pytest.fixture
async def servers(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    await factory.stop_all()


async def test_good_token_registers_with_an_ack_and_the_profile(servers):
    srv = await servers.start()
    profile = DeviceProfile.model_validate({"os": {"platform": "linux"}, "tags": ["lab"]})
    dev = srv.device("laptop", profile=profile)
    ack = await dev.register()
    assert ack.type is ServerMessageType.REGISTER_ACK
    assert ack.payload == {"device": "laptop", "heartbeat_interval": 5.0, "heartbeat_timeout": 30.0,
                           "grace_period": 5.0, "max_frame_bytes": 4096, "resumed": False}
    record = srv.hub.registry.get("laptop")
    assert record.status == "online" and record.platform == "linux" and record.profile.tags == ["lab"]
    assert record.address.startswith("127.0.0.1:")
    [stored] = await srv.store.call(srv.store.devices.all, in_order=True)  # after the row written behind
    assert stored.name == "laptop" and stored.profile["os"]["platform"] == "linux"
    await dev.sync()  # heartbeats are answered


@pytest.mark.parametrize("authorization, why", [
    ("", "no token"),
    ("Bearer tdev_not-a-real-token", "unknown or revoked"),
    ("Basic dXNlcjpwdw==", "must be 'Bearer"),
])
async def test_missing_or_bad_token_is_refused_at_the_handshake(servers, authorization, why):
    """Refused before the upgrade (401 with the reason): the server never reads a frame from it."""
    srv = await servers.start()
    dev = FakeDevice(srv.url, None, name="laptop")
    assert await handshake_refusal(dev, authorization=authorization) == (401, why)
    assert srv.hub.registry.get("laptop") is None


async def handshake_refusal(dev: FakeDevice, authorization: str | None = None) -> tuple[int, str]:
    with pytest.raises(InvalidStatus) as refused:
        await dev.connect(authorization=authorization)
    response = refused.value.response
    error = json.loads(response.body)["error"]
    return response.status_code, next((w for w in ("no token", "unknown or revoked", "must be 'Bearer",
                                                   "API token") if w in error), error)


async def test_revoked_token_and_api_token_are_refused(servers):
    srv = await servers.start()
    token = srv.token("laptop")
    assert srv.store.tokens.revoke("laptop") == 1
    assert await handshake_refusal(FakeDevice(srv.url, token, name="laptop")) == (401, "unknown or revoked")
    _, api = srv.store.tokens.create("api", "laptop", ["admin"])
    assert await handshake_refusal(FakeDevice(srv.url, api, name="laptop")) == (401, "API token")


async def test_identity_comes_from_the_token_not_the_claim(servers):
    srv = await servers.start()
    dev = FakeDevice(srv.url, srv.token("laptop"))
    answer = await dev.register(claim="box")
    assert answer.type is ServerMessageType.REGISTER_REFUSED
    assert "'laptop'" in answer.error and "'box'" in answer.error
    assert (await dev.close_code())[0] == CloseCode.WRONG_DEVICE
    assert srv.hub.registry.get("box") is None
    unnamed = FakeDevice(srv.url, srv.token("laptop"))  # no claim at all: the token decides
    assert (await unnamed.register(claim=None)).payload["device"] == "laptop"


async def test_duplicate_live_device_is_refused_and_the_first_keeps_working(servers):
    srv = await servers.start()
    token = srv.token("laptop")
    first = FakeDevice(srv.url, token, name="laptop")
    assert (await first.register()).type is ServerMessageType.REGISTER_ACK
    second = FakeDevice(srv.url, token, name="laptop")  # another process: another instance_id
    answer = await second.register()
    assert answer.type is ServerMessageType.REGISTER_REFUSED and "already connected" in answer.error
    assert (await second.close_code())[0] == CloseCode.DUPLICATE
    serving = first.serve_forever()
    [result] = await srv.hub.dispatcher("laptop").execute_commands([Command(tool_name="noop")], timeout=WAIT)
    assert result.status is ResultStatus.SUCCESS
    serving.cancel()


async def test_reconnect_with_the_same_instance_replaces_the_old_connection(servers):
    srv = await servers.start()
    token = srv.token("laptop")
    old = FakeDevice(srv.url, token, name="laptop")
    await old.register()
    new = FakeDevice(srv.url, token, name="laptop", instance_id=old.instance_id)
    ack = await new.register()
    assert ack.type is ServerMessageType.REGISTER_ACK and ack.payload["resumed"] is True
    assert await old.close_code() == (CloseCode.REPLACED, "replaced by a new connection")
    await new.sync()
    assert srv.hub.registry.get("laptop").status == "online"


@pytest.mark.parametrize("first_frame, why", [
    (json.dumps({"type": "register", "protocol_version": "2.0", "payload": {"instance_id": "x"}}),
     "protocol version 2.0 is not supported (this side speaks 1.0)"),
    ('{"type": "register", ', "not valid JSON"),
    (ClientMessage(type=ClientMessageType.HEARTBEAT, payload={"running": 0}).model_dump_json(),
     "first frame must be a register message"),
    (ClientMessage(type=ClientMessageType.REGISTER, payload={"name": "laptop"}).model_dump_json(),
     "instance_id"),
])
async def test_a_bad_first_frame_is_refused_with_4400(servers, first_frame, why):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.connect()
    await dev.send(first_frame)
    answer = await dev.recv()
    assert answer.type is ServerMessageType.REGISTER_REFUSED and why in answer.error
    assert (await dev.close_code())[0] == CloseCode.BAD_REGISTRATION


async def test_no_registration_in_time_is_refused(servers):
    srv = await servers.start(register_timeout=0.2)
    dev = srv.device("laptop")
    await dev.connect()
    answer = await dev.recv()
    assert answer.type is ServerMessageType.REGISTER_REFUSED and "within 0.2s" in answer.error
    assert (await dev.close_code())[0] == CloseCode.BAD_REGISTRATION


@pytest.mark.parametrize("frame, reason", [
    ("this is not json", "not_json"),
    (json.dumps({"type": "command_results", "action_results": []}), "invalid"),
    (json.dumps({"type": "teleport"}), "invalid"),
    (json.dumps({"type": "heartbeat", "protocol_version": "9.1"}), "version"),
    ("x" * 5000, "too_large"),
    (b'\xff\xfe binary', "not_json"),
])
async def test_bad_frames_get_an_error_reply_and_the_connection_lives_on(servers, frame, reason, caplog):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    with caplog.at_level(logging.WARNING, logger="tether.server.hub"):
        await dev.send(frame)
        error = await dev.expect(ServerMessageType.ERROR)
    assert error.payload == {"reason": reason} and error.error
    assert "bad frame from device laptop" in caplog.text
    await dev.sync()
    serving = dev.serve_forever()
    [result] = await srv.hub.dispatcher("laptop").execute_commands([Command(tool_name="noop")], timeout=WAIT)
    assert result.ok
    serving.cancel()


async def test_a_frame_over_the_transport_limit_closes_that_socket_only(servers):
    srv = await servers.start(ws_max_size=16_384)
    dev = srv.device("laptop")
    await dev.register()
    await dev.send("x" * 100_000)
    assert (await dev.close_code())[0] == 1009  # the transport's own "message too big"
    assert await srv.hub.registry.wait_until(lambda: srv.hub.registry.get("laptop").status == "offline", WAIT)
    other = srv.device("box")
    assert (await other.register()).type is ServerMessageType.REGISTER_ACK


async def test_register_again_and_device_info(servers):
    srv = await servers.start()
    dev = srv.device("laptop")
    await dev.register()
    await dev.send(ClientMessage(type=ClientMessageType.REGISTER, payload={"instance_id": "again"}))
    assert "already registered" in (await dev.expect(ServerMessageType.ERROR)).error
    await dev.send(ClientMessage(type=ClientMessageType.DEVICE_INFO, payload={"gpu": {"available": True}}))
    await dev.sync()
    assert srv.hub.registry.get("laptop").profile.gpu.available
    assert (await srv.store.call(srv.store.devices.all, in_order=True))[0].profile["gpu"]["available"] is True


async def test_heartbeats_report_load_and_silence_marks_the_device_offline(servers, caplog):
    srv = await servers.start(heartbeat_interval=0.05, heartbeat_timeout=0.3)
    dev = srv.device("laptop")
    await dev.register()
    await dev.sync(running=2)
    record = srv.hub.registry.get("laptop")
    assert (record.load, record.status) == (2, "busy")
    with caplog.at_level(logging.INFO, logger="tether.server.hub"):
        assert await srv.hub.registry.wait_until(lambda: record.status == "offline", WAIT)
        assert await dev.close_code() == (CloseCode.HEARTBEAT_TIMEOUT, "heartbeat timeout")
    assert "device laptop offline: no frame for" in caplog.text and "(timeout 0.3s)" in caplog.text
    assert record.load == 0 and not srv.hub.connected("laptop")


async def test_devices_known_before_a_restart_are_listed_offline(servers, tmp_path):
    srv = await servers.start(db_path=tmp_path / "kept.db")
    dev = srv.device("laptop", profile=DeviceProfile.model_validate({"os": {"platform": "linux"}}))
    await dev.register()
    await dev.close()
    await servers.stop_all()
    servers.running.clear()
    again = await servers.start(db_path=tmp_path / "kept.db")
    record = again.hub.registry.get("laptop")
    assert record.status == "offline" and record.platform == "linux" and record.last_seen


async def test_revoking_a_token_disconnects_its_device_now(servers):
    srv = await servers.start()
    laptop, box = srv.device("laptop"), srv.device("box")
    await laptop.register()
    await box.register()
    run = asyncio.create_task(srv.hub.dispatcher("laptop").execute_commands([Command(tool_name="a")], WAIT))
    await laptop.expect(ServerMessageType.COMMAND)
    assert await srv.hub.revoke_token("laptop") == 1
    assert await laptop.close_code() == (CloseCode.UNAUTHORIZED, "unauthorized: token revoked")
    [result] = await run
    assert "token of device laptop was revoked" in result.error
    assert srv.hub.registry.get("laptop").status == "offline" and srv.hub.connected("box")
    await box.sync()


async def test_after_shutdown_new_connections_are_turned_away(servers):
    srv = await servers.start()
    await srv.hub.aclose()
    dev = srv.device("laptop")
    await dev.connect()
    assert (await dev.close_code())[0] == 1001


async def test_a_revocation_by_another_process_is_noticed_by_the_liveness_watch(servers, tmp_path):
    srv = await servers.start(heartbeat_interval=0.05, heartbeat_timeout=5.0)
    dev = srv.device("laptop")
    await dev.register()
    other_process = Store(dbkit.server_db(srv.hub.settings.db_path))  # as `tether token revoke laptop` would
    assert other_process.tokens.revoke("laptop") == 1
    other_process.close()
    assert await dev.close_code() == (CloseCode.UNAUTHORIZED, "unauthorized: token revoked")
    assert srv.hub.registry.get("laptop").status == "offline"
