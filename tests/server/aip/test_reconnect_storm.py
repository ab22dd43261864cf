"""Reconnect storms (issue 13): admission control on /aip and the device's backoff.

A real uvicorn server in-process (aip_testkit) with `max_admitting=1`: a socket that has not registered
yet holds the only slot, so the next handshake is refused before the upgrade with HTTP 503, Retry-After
and `{"error": …}`; once the slot is free (a register-ack, or a close) the next one gets in. tether's own
`DeviceConnection` is refused the same way and registers on a retry. The backoff's draws are checked
against their bounds with a seeded random (no clock involved).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus
from websockets.http11 import Response

from tests.kits.aip import WAIT, FakeDevice, ServerFactory
from tether.device.link.connection import DeviceConnection, LinkHooks, LinkSettings
from tether.device.link.reconnect import RETRY_AFTER_MAX_S, backoff_delay, retry_after_of
from tether.device.local import build_device
from tether.protocol.messages import ServerMessageType
from tether.protocol.wire import CloseCode
from tether.server.aip.sockets.socket import ADMISSION_STATUS


@pytest.fixture
async def servers(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    await factory.stop_all()


async def refused(dev: FakeDevice) -> tuple[int, str | None, str]:
    with pytest.raises(InvalidStatus) as info:
        await dev.connect()
    response = info.value.response
    return response.status_code, response.headers.get("Retry-After"), json.loads(response.body)["error"]


async def test_over_the_limit_a_handshake_is_refused_with_503_and_retry_after_then_admitted(servers) -> None:
    srv = await servers.start(max_admitting=1)
    holder = srv.device("alpha")
    await holder.connect()  # upgraded, not registered: it holds the only slot
    late = srv.device("beta")
    status, retry_after, error = await refused(late)
    assert status == ADMISSION_STATUS == 503
    assert retry_after is not None and 1 <= int(retry_after) <= 10
    assert "server busy" in error and "retry after" in error
    assert srv.hub.registry.get("beta") is None
    ack = await holder.register()  # the register-ack frees the slot
    assert ack.type is ServerMessageType.REGISTER_ACK
    assert (await late.register()).type is ServerMessageType.REGISTER_ACK
    assert srv.hub.registry.get("beta").status == "online"
    await holder.sync()  # the registered device is answered throughout
    await late.sync()


async def test_a_refused_registration_frees_its_slot(servers) -> None:
    srv = await servers.start(max_admitting=1)
    liar = srv.device("alpha")
    await liar.connect()
    assert (await refused(srv.device("beta")))[0] == 503
    await liar.send("this is not a register frame")  # refused: an ERROR frame, then close 4400
    assert (await liar.close_code())[0] == CloseCode.BAD_REGISTRATION  # the slot was freed before this close
    other = srv.device("beta")
    assert (await other.register()).type is ServerMessageType.REGISTER_ACK


async def test_a_refused_to_the_limit_device_connection_registers_on_its_retry(servers, tmp_path: Path) -> None:
    srv = await servers.start(max_admitting=1)
    holder = srv.device("alpha")
    await holder.connect()
    device = build_device(state_dir=tmp_path / "dev", sandbox=False)
    refusals: asyncio.Queue[str] = asyncio.Queue()

    def on_state(state: str, conn: DeviceConnection) -> None:
        if state == "disconnected" and conn.last_error:
            refusals.put_nowait(conn.last_error)

    conn = DeviceConnection(device.client, srv.url, srv.token("beta"), name="beta",
                            settings=LinkSettings(backoff_base=0.01, backoff_cap=0.05),
                            hooks=LinkHooks(on_state=on_state))
    task = asyncio.create_task(conn.run())
    try:
        first = await asyncio.wait_for(refusals.get(), WAIT)
        assert "HTTP 503" in first
        assert srv.hub.registry.get("beta") is None
        await holder.register()  # frees the slot; the device's retry (after Retry-After) gets in
        await asyncio.wait_for(conn.connected.wait(), WAIT + 2 * RETRY_AFTER_MAX_S)
        assert srv.hub.registry.get("beta").status == "online"
    finally:
        conn.stop()
        await asyncio.wait_for(task, WAIT)
        await device.aclose()


def test_backoff_is_full_jitter_within_zero_and_the_capped_exponential() -> None:
    rng = random.Random(1313)
    for attempt in range(12):
        upper = min(30.0, 0.5 * 2 ** attempt)
        draws = [backoff_delay(attempt, 0.5, 30.0, rng.random) for _ in range(2000)]
        assert all(0.0 <= d <= upper for d in draws)
        # full jitter: the draws cover the whole window, not a band near its top
        assert min(draws) < 0.05 * upper and max(draws) > 0.95 * upper


def test_first_attempt_after_a_lost_link_is_spread_and_a_busy_server_is_waited_for() -> None:
    rng = random.Random(7)
    spread = [backoff_delay(0, 0.5, 30.0, rng.random, spread=2.0) for _ in range(2000)]
    assert all(0.0 <= d <= 2.0 for d in spread) and max(spread) > 1.9
    assert all(backoff_delay(0, 0.5, 1.0, rng.random, spread=2.0) <= 1.0 for _ in range(200))  # the cap wins
    # inside a grace window the spread is held to its share, as every attempt is
    assert all(backoff_delay(0, 0.5, 30.0, rng.random, spread=2.0, grace_left=2.0) <= 0.5 for _ in range(200))
    for attempt in (0, 3, 12):  # a busy server's Retry-After sets the window, whatever the attempt
        waited = [backoff_delay(attempt, 0.5, 30.0, rng.random, retry_after=2.0) for _ in range(2000)]
        assert all(2.0 <= d <= 4.0 for d in waited) and min(waited) < 2.05 and max(waited) > 3.95


def _status(code: int, headers: dict[str, str]) -> InvalidStatus:
    from websockets.datastructures import Headers

    return InvalidStatus(Response(code, "x", Headers(headers), b""))


def test_retry_after_is_read_only_from_a_busy_answer() -> None:
    assert retry_after_of(_status(503, {"Retry-After": "3"})) == 3.0
    assert retry_after_of(_status(429, {"Retry-After": "1.5"})) == 1.5
    assert retry_after_of(_status(503, {})) is None
    assert retry_after_of(_status(503, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None
    assert retry_after_of(_status(401, {"Retry-After": "3"})) is None
    assert retry_after_of(OSError("refused")) is None
