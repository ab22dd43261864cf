"""`DELETE /api/v1/devices/{name}` (docs/fleet.md): the whole app under uvicorn, scripted AIP devices.

A removed device is disconnected, its token refused when it comes back, forgotten by the registry and
the store (a restart does not list it again), its audit rows kept plus one saying who removed it; a
fan-out afterwards neither reaches nor counts it. Only a fleet-wide admin token may remove.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.kits.aip import WAIT, FakeDevice
from tests.kits.fanout import App, running_app
from tether.protocol.messages import ServerMessageType
from tether.server.http.device_routes import REMOVE_TOOL


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    async with running_app(tmp_path) as running:
        yield running


def admin(app: App) -> str:
    return app.store.tokens.create("api", "boss", ["admin"])[1]


async def test_removing_an_online_device_disconnects_it_and_refuses_its_token(app: App) -> None:
    token = app.store.tokens.create("device", "lab1")[1]
    dev = FakeDevice(f"ws://127.0.0.1:{app.port}/aip", token, name="lab1")
    assert (await dev.register()).type is ServerMessageType.REGISTER_ACK
    async with app.http(admin(app)) as http:
        answer = await http.delete("/api/v1/devices/lab1")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"removed": "lab1", "was": "online", "revoked_tokens": 1}
        code, _ = await dev.close_code()
        assert code != 1000
        assert app.hub.registry.get("lab1") is None
        assert not app.store.devices.known("lab1")
        assert app.store.device_keys.get("lab1") is None
        listed = (await http.get("/api/v1/devices")).json()
        assert "lab1" not in [d["name"] for d in listed]
        assert (await http.get("/api/v1/devices/lab1")).status_code == 404
        assert (await http.delete("/api/v1/devices/lab1")).status_code == 404  # gone: nothing left to remove
        rows = (await http.get("/api/v1/audit", params={"device": "lab1"})).json()["rows"]
        removal = [r for r in rows if r["tool_name"] == REMOVE_TOOL]
        assert removal and removal[0]["requested_by"] == "api:boss"
    again = FakeDevice(f"ws://127.0.0.1:{app.port}/aip", token, name="lab1")
    try:
        answer_frame = await again.register()
        refused = answer_frame.type is not ServerMessageType.REGISTER_ACK
    except Exception:  # refused at the handshake, or closed before answering
        refused = True
    assert refused
    assert app.hub.registry.get("lab1") is None


async def test_removing_an_offline_device_and_a_fan_out_after_it(app: App) -> None:
    serving = (await app.device("ok1")).serve_forever()
    gone = await app.device("old")
    await gone.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("old"), WAIT)
    async with app.http() as runner:
        body = {"commands": [{"tool_name": "noop", "parameters": {"n": 1}}]}
        before = (await runner.post("/api/v1/fleet/commands", json=body)).json()
        assert before["summary"]["offline"] == 1
        async with app.http(admin(app)) as http:
            answer = await http.delete("/api/v1/devices/old")
            assert answer.status_code == 200, answer.text
            assert answer.json()["was"] == "offline"
        after = (await runner.post("/api/v1/fleet/commands", json=body)).json()
        assert after["summary"]["offline"] == 0 and after["summary"]["ok"] == 1, after
    serving.cancel()


async def test_a_revoked_device_is_not_counted_by_a_fan_out(app: App) -> None:
    serving = (await app.device("ok1")).serve_forever()
    gone = await app.device("retired")
    await gone.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("retired"), WAIT)
    app.store.tokens.revoke("retired")
    async with app.http() as runner:
        body = {"commands": [{"tool_name": "noop", "parameters": {"n": 1}}]}
        summary = (await runner.post("/api/v1/fleet/commands", json=body)).json()["summary"]
        assert summary["offline"] == 0 and summary["ok"] == 1, summary
    serving.cancel()


async def test_only_a_fleet_wide_admin_token_removes(app: App) -> None:
    await app.device("lab1")
    scoped = app.store.tokens.create("api", "scoped", ["admin"], devices=["other"])[1]
    agent = app.store.tokens.create("api", "bot", ["read", "execute"], agent=True)[1]
    for token, status in ((scoped, 403), (agent, 403), (app.runner, 403), ("", 401)):
        async with app.http(token) as http:
            answer = await http.delete("/api/v1/devices/lab1")
            assert answer.status_code == status, (token, answer.text)
            assert "error" in answer.json()
    assert app.hub.registry.get("lab1") is not None
