"""Fan-out (issue 13): `POST /api/v1/fleet/commands` runs one batch on every matching device.

The whole app (`create_app`) under a real uvicorn on 127.0.0.1, scripted AIP devices (aip_testkit) on
real sockets that answer, hold or drop exactly when a test says so, and httpx as the REST caller.
Nothing waits on time except where the timeout is the feature under test.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits.aip import WAIT, FakeDevice, ok
from tests.kits.fanout import App, running_app
from tether.protocol.messages import ServerMessage, ServerMessageType
from tether.protocol.models import Result

CHEAP = {"tool_name": "noop", "parameters": {"n": 1}}
NDJSON = {"Accept": "application/x-ndjson"}


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[App]:
    async with running_app(tmp_path) as running:
        yield running


def body(**extra: Any) -> dict[str, Any]:
    return {"commands": [CHEAP], **extra}


async def lines(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if line:
            yield json.loads(line)


async def hold(dev: FakeDevice) -> ServerMessage:
    """The device's next COMMAND, left unanswered."""
    return await dev.expect(ServerMessageType.COMMAND)


async def test_every_matching_device_runs_the_batch_and_the_ndjson_stream_says_so(app: App) -> None:
    devs = [await app.device(n, ["lab"]) for n in ("a1", "a2", "a3")]
    other = await app.device("b1", ["office"])
    serving = [d.serve_forever() for d in [*devs, other]]
    async with app.http() as http, http.stream("POST", "/api/v1/fleet/commands", headers=NDJSON,
                                               json=body(requires={"tags": ["lab"]})) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        got = [line async for line in lines(response)]
    head, *per_device, tail = got
    assert head["fanout"]["total"] == 3 and head["fanout"]["id"] == response.headers["X-Tether-Fanout"]
    assert sorted(line["device"] for line in per_device) == ["a1", "a2", "a3"]
    for line in per_device:
        assert line["status"] == "ok" and line["duration"] >= 0
        [result] = line["results"]
        assert result["status"] == "success" and result["result"] == {"tool": "noop", "args": {"n": 1}}
    assert tail["summary"]["ok"] == 3 and tail["summary"]["total"] == 3
    assert {k: tail["summary"][k] for k in ("failed", "offline", "timed_out", "cancelled")} == \
        dict.fromkeys(("failed", "offline", "timed_out", "cancelled"), 0)
    audited = {r["device"] for r in app.store.audit.rows(limit=50)}
    assert audited == {"a1", "a2", "a3"}  # the same audit path as one device's commands; b1 untouched
    for task in serving:
        task.cancel()


async def test_a_plain_json_answer_and_the_sse_framing(app: App) -> None:
    serving = [(await app.device(n)).serve_forever() for n in ("a1", "a2")]
    async with app.http() as http:
        whole = await http.post("/api/v1/fleet/commands", json=body())
        assert whole.status_code == 200
        data = whole.json()
        assert data["fanout"] == whole.headers["X-Tether-Fanout"]
        assert [d["status"] for d in data["devices"]] == ["ok", "ok"] and data["summary"]["ok"] == 2
        async with http.stream("POST", "/api/v1/fleet/commands", headers={"Accept": "text/event-stream"},
                               json=body()) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            text = (await response.aread()).decode()
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    kinds = [e[0].removeprefix("event: ") for e in events]
    assert kinds == ["fanout", "device", "device", "summary"]
    payloads = [json.loads(e[1].removeprefix("data: ")) for e in events]
    assert payloads[0]["total"] == 2 and payloads[-1]["summary"]["ok"] == 2
    assert {p["device"] for p in payloads[1:3]} == {"a1", "a2"}
    for task in serving:
        task.cancel()


async def test_a_failing_command_and_a_device_offline_at_the_start(app: App) -> None:
    good = await app.device("a1")
    bad = await app.device("a2")
    gone = await app.device("a3")
    await gone.close()
    assert await app.hub.registry.wait_until(lambda: not app.hub.connected("a3"), WAIT)
    serving = [good.serve_forever(),
               bad.serve_forever(lambda c: Result.failure("no such file", c.call_id))]
    async with app.http() as http:
        data = (await http.post("/api/v1/fleet/commands", json=body())).json()
    by = {d["device"]: d for d in data["devices"]}
    assert by["a1"]["status"] == "ok"
    assert by["a2"]["status"] == "failed" and by["a2"]["error"] == "no such file"
    assert by["a2"]["results"][0]["status"] == "failure"
    assert by["a3"]["status"] == "offline" and "offline" in by["a3"]["error"] and "results" not in by["a3"]
    assert data["summary"] | {"duration": 0} == {"ok": 1, "failed": 1, "offline": 1, "timed_out": 0,
                                                 "cancelled": 0, "total": 3, "duration": 0}
    for task in serving:
        task.cancel()


async def test_a_device_leaving_while_its_command_runs_is_offline_not_hung(app: App) -> None:
    stays = await app.device("a1")
    leaves = await app.device("a2")
    serving = stays.serve_forever()
    async with app.http() as http, http.stream("POST", "/api/v1/fleet/commands", headers=NDJSON,
                                               json=body(timeout=600)) as response:
        stream = lines(response)
        assert (await anext(stream))["fanout"]["total"] == 2
        first = await anext(stream)
        assert first["device"] == "a1" and first["status"] == "ok"
        await hold(leaves)  # the command is on the device, unanswered
        leaves.abort()  # the link drops while it runs (grace period 30 s, fan-out timeout 600 s)
        second = await anext(stream)
        tail = await anext(stream)
    assert second["device"] == "a2" and second["status"] == "offline"
    assert "went offline while its batch ran" in second["error"]
    assert tail["summary"]["offline"] == 1 and tail["summary"]["ok"] == 1
    serving.cancel()


async def test_the_concurrency_cap_is_honoured(app: App) -> None:
    names = [f"d{i}" for i in range(6)]
    devs = {n: await app.device(n) for n in names}
    arrivals: asyncio.Queue[tuple[str, ServerMessage]] = asyncio.Queue()
    release = {n: asyncio.Event() for n in names}
    outstanding: set[str] = set()
    most = 0

    async def device_side(name: str) -> None:
        message = await hold(devs[name])
        await arrivals.put((name, message))
        await release[name].wait()
        outstanding.discard(name)  # before the answer leaves: the count seen here never exceeds the server's
        await devs[name].results(message.response_id, [ok(c) for c in message.actions or []])

    sides = [asyncio.create_task(device_side(n)) for n in names]
    async with app.http() as http, http.stream("POST", "/api/v1/fleet/commands", headers=NDJSON,
                                               json=body(max_concurrency=2, timeout=600)) as response:
        stream = lines(response)
        fan_id = (await anext(stream))["fanout"]["id"]
        fan = app.app.state.fanouts[fan_id]
        for _ in names:
            name, _message = await asyncio.wait_for(arrivals.get(), WAIT)
            outstanding.add(name)
            most = max(most, len(outstanding))
            if len(outstanding) == 2 or len(outstanding) == len(names) - sum(e.is_set() for e in release.values()):
                release[sorted(outstanding)[0]].set()  # one finishes; only then may the next one start
        for event in release.values():
            event.set()
        got = [line async for line in stream]
    assert most == 2 and fan.max_in_flight == 2
    assert [line["status"] for line in got[:-1]] == ["ok"] * 6 and got[-1]["summary"]["ok"] == 6
    await asyncio.gather(*sides)


async def test_cancelling_a_fan_out_cancels_the_commands_on_the_devices(app: App) -> None:
    devs = [await app.device(n) for n in ("a1", "a2", "a3")]
    async with app.http() as http, http.stream("POST", "/api/v1/fleet/commands", headers=NDJSON,
                                               json=body(max_concurrency=2, timeout=600)) as response:
        stream = lines(response)
        fan_id = (await anext(stream))["fanout"]["id"]
        held = [await hold(devs[0]), await hold(devs[1])]  # a3 waits for a slot
        answer = await http.delete(f"/api/v1/fleet/commands/{fan_id}")
        assert answer.status_code == 200 and answer.json() == {"cancelled": fan_id}
        got = [line async for line in stream]
        for dev, command in zip(devs[:2], held, strict=True):
            cancel = await dev.expect(ServerMessageType.CANCEL)
            assert cancel.response_id == command.response_id
        missing = await http.delete(f"/api/v1/fleet/commands/{fan_id}")
        assert missing.status_code == 404 and "no fan-out" in missing.json()["error"]
    by = {line["device"]: line for line in got[:-1]}
    assert {n: line["status"] for n, line in by.items()} == dict.fromkeys(("a1", "a2", "a3"), "cancelled")
    assert "DELETE /api/v1/fleet/commands" in by["a1"]["error"] and by["a3"]["error"].startswith("not sent")
    assert got[-1]["summary"]["cancelled"] == 3


async def test_a_caller_who_goes_away_cancels_the_outstanding_commands(app: App) -> None:
    devs = [await app.device(n) for n in ("a1", "a2")]
    async with app.http() as http:
        async with http.stream("POST", "/api/v1/fleet/commands", headers=NDJSON,
                               json=body(timeout=600)) as response:
            # the line iterator is kept: one dropped after `anext` is finalized (aclose), which closes the
            # response, and the server rightly cancels a fan-out whose caller went away before it sent anything
            stream = lines(response)
            await anext(stream)
            held = [await hold(d) for d in devs]
        # the response is closed here: the caller is gone
        for dev, command in zip(devs, held, strict=True):
            cancel = await dev.expect(ServerMessageType.CANCEL)
            assert cancel.response_id == command.response_id
    assert await app.hub.registry.wait_until(lambda: not app.app.state.fanouts, WAIT)


async def test_the_overall_timeout_ends_stragglers_as_timed_out(app: App) -> None:
    quick = await app.device("a1")
    slow = await app.device("a2")
    serving = quick.serve_forever()
    async with app.http() as http:
        posted = asyncio.create_task(http.post("/api/v1/fleet/commands", json=body(timeout=0.5)))
        command = await hold(slow)  # never answered: the fan-out's timeout is what ends it
        cancel = await slow.expect(ServerMessageType.CANCEL)
        data = (await posted).json()
    assert cancel.response_id == command.response_id
    by = {d["device"]: d for d in data["devices"]}
    assert by["a1"]["status"] == "ok" and by["a2"]["status"] == "timed_out"
    assert "timeout of 0.5s" in by["a2"]["error"] and data["summary"]["timed_out"] == 1
    serving.cancel()


async def test_errors_are_clear_and_nothing_is_sent(app: App) -> None:
    dev = await app.device("a1", ["lab"])
    async with app.http() as http:
        none = await http.post("/api/v1/fleet/commands", json=body(requires={"tags": ["gpu-farm"]}))
        assert none.status_code == 404
        assert none.json() == {"error": 'no device fits {tags: ["gpu-farm"]}: none of the 1 known device(s) fits'}
        bad = await http.post("/api/v1/fleet/commands", json=body(max_concurrency=0))
        assert bad.status_code == 422 and "max_concurrency" in bad.json()["error"]
        empty = await http.post("/api/v1/fleet/commands", json={"commands": []})
        assert empty.status_code == 422 and set(empty.json()) == {"error"}
        extra = await http.post("/api/v1/fleet/commands", json=body(session_id="x"))
        assert extra.status_code == 422
    async with app.http("") as anonymous:
        assert (await anonymous.post("/api/v1/fleet/commands", json=body())).status_code == 401
    async with app.http(app.reader) as reader:
        refused = await reader.post("/api/v1/fleet/commands", json=body())
        assert refused.status_code == 403 and "execute" in refused.json()["error"]
    await dev.sync()  # every frame the server sent before this reply is here: no command among them
    assert app.store.audit.rows(limit=10) == []


async def test_the_route_is_in_the_openapi_document(app: App) -> None:
    async with app.http() as http:
        document = (await http.get("/openapi.json")).json()
    assert "post" in document["paths"]["/api/v1/fleet/commands"]
    assert "delete" in document["paths"]["/api/v1/fleet/commands/{fanout_id}"]
