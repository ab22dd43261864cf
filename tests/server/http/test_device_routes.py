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
from tether.server.http.routes.device_changes import REMOVE_TOOL


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


async def test_tags_are_set_kept_over_the_devices_own_and_survive_reconnects(app: App) -> None:
    dev = await app.device("lab1", ["own"])
    async with app.http(admin(app)) as http:
        answer = await http.patch("/api/v1/devices/lab1", json={"tags": ["gpu", "lab", "gpu"]})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"name": "lab1", "tags": ["gpu", "lab"]}
        assert (await http.get("/api/v1/devices/lab1")).json()["tags"] == ["gpu", "lab"]
        listed = (await http.get("/api/v1/devices", params={"tag": "gpu"})).json()
        assert [d["name"] for d in listed] == ["lab1"]
        assert (await http.get("/api/v1/devices", params={"tag": "own"})).json() == []
        await dev.close()
        assert await app.hub.registry.wait_until(lambda: not app.hub.connected("lab1"), WAIT)
        again = FakeDevice(f"ws://127.0.0.1:{app.port}/aip", dev.token, name="lab1")
        from tether.protocol.profile import DeviceProfile
        again.profile = DeviceProfile(tags=["own"])
        assert (await again.register()).type is ServerMessageType.REGISTER_ACK
        assert (await http.get("/api/v1/devices/lab1")).json()["tags"] == ["gpu", "lab"]
        assert app.store.devices.tag_overrides() == {"lab1": ["gpu", "lab"]}
        bad = await http.patch("/api/v1/devices/lab1", json={"tags": ["no spaces"]})
        assert bad.status_code == 422 and "error" in bad.json()
        rows = (await http.get("/api/v1/audit", params={"device": "lab1"})).json()["rows"]
        assert any(r["tool_name"] == "device.tags" and r["requested_by"] == "api:boss" for r in rows)


async def test_rename_of_an_offline_device_moves_its_token_key_and_tags(app: App) -> None:
    dev = await app.device("old", ["own"])
    token = dev.token
    async with app.http(admin(app)) as http:
        assert (await http.patch("/api/v1/devices/old", json={"tags": ["t1"]})).status_code == 200
        busy = await http.patch("/api/v1/devices/old", json={"name": "new"})
        assert busy.status_code == 409 and "connected" in busy.json()["error"]
        await dev.close()
        assert await app.hub.registry.wait_until(lambda: not app.hub.connected("old"), WAIT)
        app.hub._grace.stop("old")  # the grace period would hold the name for 30 s
        await app.device("taken")
        taken = await http.patch("/api/v1/devices/old", json={"name": "taken"})
        assert taken.status_code == 409 and "exists" in taken.json()["error"]
        bad = await http.patch("/api/v1/devices/old", json={"name": "my laptop"})
        assert bad.status_code == 422
        answer = await http.patch("/api/v1/devices/old", json={"name": "new"})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"name": "new", "tags": ["t1"]}
        assert (await http.get("/api/v1/devices/old")).status_code == 404
        moved = (await http.get("/api/v1/devices/new")).json()
        assert moved["tags"] == ["t1"] and moved["status"] == "offline"
        assert (await http.get("/api/v1/devices/new/key")).json()["fingerprint"]
    renamed = FakeDevice(f"ws://127.0.0.1:{app.port}/aip", token, name="new", key=dev.key)
    assert (await renamed.register()).type is ServerMessageType.REGISTER_ACK
    assert app.hub.connected("new") and app.hub.registry.get("new").tags == ("t1",)


async def test_rename_is_refused_while_a_token_is_scoped_to_the_name(app: App) -> None:
    dev = await app.device("old")
    await dev.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("old"), WAIT)
    app.hub._grace.stop("old")
    app.store.tokens.create("api", "watcher", ["read"], devices=["old"])
    async with app.http(admin(app)) as http:
        answer = await http.patch("/api/v1/devices/old", json={"name": "new"})
        assert answer.status_code == 409 and "watcher" in answer.json()["error"]
        assert app.hub.registry.get("old") is not None


async def test_scoped_and_agent_tokens_are_refused_on_each_route(app: App) -> None:
    await app.device("lab1")
    scoped = app.store.tokens.create("api", "scoped", ["admin"], devices=["other"])[1]
    agent = app.store.tokens.create("api", "bot", ["read", "execute"], agent=True)[1]
    for token in (scoped, agent):
        async with app.http(token) as http:
            for method, body in (("DELETE", None), ("PATCH", {"tags": ["x"]}), ("PATCH", {"name": "x2"})):
                answer = await http.request(method, "/api/v1/devices/lab1", json=body)
                assert answer.status_code == 403, (method, answer.text)
    async with app.http(scoped) as http:  # a read route: a device outside the scope is not there for it
        assert (await http.get("/api/v1/devices/lab1/key")).status_code == 404
    assert app.hub.registry.get("lab1").tags == ()


async def test_a_revoked_device_is_not_counted_by_a_task_steps_fan_out(app: App) -> None:
    """`DeviceHub.fan_out` (a plan's `on: all` step, the agent) leaves it out as the REST route does."""
    from tether.protocol.models import Command
    from tether.protocol.profile import DeviceRequirements

    serving = (await app.device("ok1")).serve_forever()
    gone = await app.device("retired")
    await gone.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("retired"), WAIT)
    before = await app.hub.fan_out(DeviceRequirements(), [Command(tool_name="noop", parameters={"n": 1})])
    assert before["summary"]["offline"] == 1
    app.store.tokens.revoke("retired")
    after = await app.hub.fan_out(DeviceRequirements(), [Command(tool_name="noop", parameters={"n": 1})])
    assert after["summary"]["offline"] == 0 and after["summary"]["ok"] == 1, after
    serving.cancel()
