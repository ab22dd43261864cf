"""The live view in a cluster: two real `tether server` nodes on a real redis-server, a real `tether device`
connected to node `a` only, its desktop a private Xvfb running the Tk test program (the fixtures of
tests/web/test_live_view.py). A person views the device through node `b`: frames come through `a`, an
agent's click asked on `a` is drawn on `b`'s view, the person's take-over made on `b` refuses agents'
desktop actions asked on either node (naming the person), the person's own click through `b` lands, and
handing back on `b` lets the agent act again through both nodes. When node `a` dies while the person holds
the desktop, the device moves to `b` and the hold follows it (agents still refused); a page that goes
away releases it. The program's event log and the view's events are waited on, never slept on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.kit.engines import Engine
from tests.kits.cluster import ClusterKit, Node
from tests.kits.desktop import GuiApp
from tests.kits.sse import async_sse_events
from tests.web.test_live_view import gui, xvfb  # noqa: F401 (the module's Xvfb and Tk program)

WAIT_S = 30.0


class View:
    """A live view's event stream on one node, read into a queue: `next(kind)` waits for the next such event."""

    def __init__(self, node: Node, token: str) -> None:
        self.base = f"{node.url}/web/devices/alpha/screen"
        self.headers = {"Authorization": f"Bearer {token}"}
        self.events: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self.stream = ""

    async def read(self, http: httpx.AsyncClient) -> None:
        async with http.stream("GET", self.base, headers=self.headers) as response:
            assert response.status_code == 200, await response.aread()
            async for kind, data in async_sse_events(response.aiter_lines()):
                if kind:
                    await self.events.put((kind, data))

    async def next(self, kind: str, **fields: Any) -> dict[str, Any]:
        async with asyncio.timeout(WAIT_S):
            while True:
                got, data = await self.events.get()
                if got == kind and all(data.get(k) == v for k, v in fields.items()):
                    return data

    async def post(self, http: httpx.AsyncClient, what: str, **body: Any) -> httpx.Response:
        return await http.post(f"{self.base}/{what}", json={"stream": self.stream, **body}, headers=self.headers)


@contextlib.asynccontextmanager
async def viewing(node: Node, token: str) -> AsyncIterator[tuple[View, httpx.AsyncClient]]:
    view = View(node, token)
    async with httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S, read=None)) as http:
        reader = asyncio.create_task(view.read(http))
        try:
            view.stream = (await view.next("hello"))["stream"]
            yield view, http
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def click(node: Node, token: str, at: list[int]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=WAIT_S * 2) as http:
        r = await http.post(f"{node.url}/api/v1/devices/alpha/commands", headers={"Authorization": f"Bearer {token}"},
                            json={"commands": [{"tool_name": "click", "parameters": {"x": at[0], "y": at[1]}}],
                                  "timeout": WAIT_S})
    assert r.status_code == 200, r.text
    [result] = r.json()["results"]
    return dict(result)


@pytest.mark.timeout(120)
async def test_a_view_through_another_node_sees_draws_holds_and_hands_back(
        tmp_path: Path, redis_engine: Engine, xvfb: str, gui: GuiApp) -> None:  # noqa: F811
    buttons = gui.events("ready")[0]["buttons"]
    async with ClusterKit(tmp_path, redis=redis_engine) as kit:
        a, b = await asyncio.gather(kit.start_node("a"), kit.start_node("b"))
        device = await kit.start_device("alpha", [a, b], env={"DISPLAY": xvfb, "DBUS_SESSION_BUS_ADDRESS": "",
                                                           "AT_SPI_BUS_ADDRESS": ""})
        assert (await device.registered()) is a
        person = await kit.token("api", "ada", ["execute"])
        made = await kit.http(a).post("/tokens", json={"kind": "api", "name": "agent-007", "scopes": ["execute"],
                                                       "agent": True})
        assert made.status_code == 201, made.text
        agent = made.json()["token"]
        async with viewing(b, person) as (view, http):
            frame = await view.next("frame")  # fetched from the device through node a
            assert frame["png"] and frame["width"] == 1280
            # an agent's click asked on node a is drawn on node b's view
            assert (await click(a, agent, buttons["cancel"]))["status"] == "success"
            await gui.wait_count("cancel", 1)
            drawn = await view.next("action", tool="click", by="agent-007")
            assert drawn["parameters"] == {"x": buttons["cancel"][0], "y": buttons["cancel"][1]}
            assert (await view.next("result", tool="click"))["status"] == "success"
            # the person takes over on node b: agents' desktop actions are refused on both nodes, naming them
            taken = await view.post(http, "take")
            assert taken.status_code == 200 and taken.json()["holder"] == "ada", taken.text
            assert (await view.next("hold"))["holder"] == "ada"
            for node in (a, b):
                refused = await click(node, agent, buttons["cancel"])
                assert refused["status"] == "failure" and "a person (ada) has taken over" in refused["error"], refused
            assert (await view.next("result", tool="click", status="failure"))["error"]
            # a second person cannot take it from node a either
            other = await kit.token("api", "bob", ["execute"])
            async with viewing(a, other) as (bobs, bob_http):
                refused_take = await bobs.post(bob_http, "take")
                assert refused_take.status_code == 409 and "held by ada" in refused_take.json()["error"]
            # the person's own click through node b lands; keeping the hold works across nodes
            acted = await view.post(http, "act", tool="click",
                                    parameters={"x": buttons["submit"][0], "y": buttons["submit"][1]})
            assert acted.status_code == 200 and acted.json()["result"]["status"] == "success", acted.text
            await gui.wait_event("submit", via="button")
            assert (await view.next("action", tool="click", person=True))["by"] == "ada"
            assert (await view.post(http, "keep")).json() == {"held": True}
            assert len(gui.events("cancel")) == 1  # the refused clicks did nothing
            # handing back on node b: the agent acts again, through either node
            released = await view.post(http, "release")
            assert released.json() == {"released": True}, released.text
            assert (await view.next("hold"))["holder"] is None
            assert (await view.post(http, "keep")).json() == {"held": False}
            assert (await click(b, agent, buttons["cancel"]))["status"] == "success"
            assert (await click(a, agent, buttons["cancel"]))["status"] == "success"
            await gui.wait_count("cancel", 3)
            # the person takes over again; node a (holding the device and the hold) dies: the device moves to
            # node b and the hold follows it there, so agents are still refused
            assert (await view.post(http, "take")).status_code == 200
            assert (await view.next("hold"))["holder"] == "ada"
            assert (await click(a, agent, buttons["cancel"]))["status"] == "failure"
            since = len(device.process.lines)
            await kit.kill_node(a)
            assert (await device.registered(since)) is b
            assert (await view.next("hold"))["holder"] == "ada"  # taken again on node b, where the device is
            refused = await click(b, agent, buttons["cancel"])
            assert refused["status"] == "failure" and "a person (ada) has taken over" in refused["error"], refused
            assert (await view.post(http, "keep")).json() == {"held": True}
        # the page goes away while holding: the hold is released
        audit = await kit.http(b).get("/audit?device=alpha&limit=200")

        async def handed_back() -> bool:
            rows = (await kit.http(b).get("/audit?device=alpha&limit=200")).json()["rows"]
            return any(r["tool_name"] == "screen.hand_back" and "went away" in str(r.get("arguments")) for r in rows)

        async with asyncio.timeout(WAIT_S):
            while not await handed_back():
                await asyncio.sleep(0.2)  # polling the audit: the hand-back is written off the stream's path
        assert (await click(b, agent, buttons["cancel"]))["status"] == "success"
        await gui.wait_count("cancel", 4)
        rows = audit.json()["rows"]
        assert any(r["tool_name"] == "click" and r["requested_by"] == "api:ada" and r["status"] == "success"
                   for r in rows), rows[:5]
        assert any(r["tool_name"] == "screen.take" and "moved" in str(r.get("arguments")) for r in rows), rows[:5]
