"""The live view of a device's screen, in the system Chromium against a real `tether server` and a real
`tether device` whose desktop is a private Xvfb running the Tk test program: the view shows a frame, an
agent's click is drawn on it, a person takes over (the agent's click is then refused naming them), the
person's click lands in the program, handing back lets the agent act again, and a page that goes away
releases the desktop. The program's event log is waited on, never slept on."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits.desktop import GUI_APP, EventLog, GuiApp, require_programs, running_xvfb
from tests.kits.netutil import Cluster, wait_for
from tests.web.test_dashboard import Dash, browser  # noqa: F401 (the module's browser fixture)

SCREEN_W = 1280


def in_thread(coro: Any) -> Any:
    """Run a wait of the Tk program's log on its own loop: Playwright's sync API holds this thread's loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.fixture(scope="module")
def xvfb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_programs()
    with running_xvfb(tmp_path_factory.mktemp("xvfb") / "xvfb.log") as display:
        yield display


@pytest.fixture(scope="module")
def gui(xvfb: str) -> Iterator[GuiApp]:
    import subprocess

    folder = Path(tempfile.mkdtemp(prefix="tether-live-"))
    log = EventLog(folder / "events.jsonl")
    proc = subprocess.Popen([sys.executable, str(GUI_APP), str(log)], env={**os.environ, "DISPLAY": xvfb})
    app = GuiApp(proc, log)
    in_thread(app.wait_event("ready"))
    yield app
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, xvfb: str, gui: GuiApp) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("live"))
    env = {"DISPLAY": xvfb, "DBUS_SESSION_BUS_ADDRESS": "", "AT_SPI_BUS_ADDRESS": ""}
    alpha = c.device("alpha", env=env)
    c.wait_online("alpha", alpha)
    yield c
    c.close()


def api(cluster: Cluster, method: str, path: str, token: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"http://127.0.0.1:{cluster.port}/api/v1{path}", timeout=60,
                         headers={"Authorization": f"Bearer {token}"}, **kw)


@pytest.fixture(scope="module")
def agent(cluster: Cluster) -> str:
    made = api(cluster, "POST", "/tokens", cluster.api_token,
               json={"kind": "api", "name": "agent-007", "scopes": ["execute"], "agent": True})
    assert made.status_code == 201, made.text
    return made.json()["token"]


def agent_click(cluster: Cluster, token: str, at: list[int]) -> dict[str, Any]:
    r = api(cluster, "POST", "/devices/alpha/commands", token,
            json={"commands": [{"tool_name": "click", "parameters": {"x": at[0], "y": at[1]}}], "timeout": 30})
    assert r.status_code == 200, r.text
    [result] = r.json()["results"]
    return result


def audit_rows(cluster: Cluster) -> list[dict[str, Any]]:
    return api(cluster, "GET", "/audit?device=alpha&limit=200", cluster.api_token).json()["rows"]


def open_view(dash: Dash) -> Any:
    from playwright.sync_api import expect

    dash.page.get_by_role("link", name="alpha").click()
    dash.page.locator("#screen-link").click()
    img = dash.page.locator("#screen-img")
    expect(img).to_have_attribute("data-seq", __import__("re").compile(r"\d+"))  # a frame is shown
    return img


def test_watch_take_over_act_and_hand_back(browser: object, cluster: Cluster, gui: GuiApp,  # noqa: F811
                                           agent: str) -> None:
    from playwright.sync_api import expect

    buttons = gui.events("ready")[0]["buttons"]
    person = Dash(browser, cluster, cluster.api_token)  # the token named "tests": a person's
    try:
        img = open_view(person)
        page = person.page
        holder = page.locator("#holder")
        expect(holder).to_contain_text("The agent has the desktop")
        # the agent clicks Cancel: it lands, and the view draws it where it was, saying how
        assert agent_click(cluster, agent, buttons["cancel"])["status"] == "success"
        in_thread(gui.wait_count("cancel", 1))
        mark = page.locator('.mark[data-tool="click"]').first
        expect(mark).to_contain_text("click")
        expect(page.locator("#actions")).to_contain_text("by agent-007")
        person.shot("live-view-agent-click")
        # the person takes over: the agent's next click is refused, naming who holds the desktop
        page.get_by_role("button", name="Take over").click()
        expect(holder).to_contain_text("Held by tests")
        refused = agent_click(cluster, agent, buttons["cancel"])
        assert refused["status"] == "failure" and "tests" in refused["error"] and "taken over" in refused["error"], \
            refused
        expect(page.locator("#actions")).to_contain_text("failure")  # the refused try is shown too
        hostile = '<img src=x onerror="document.title=1"><b>bold</b>'  # what an agent sends is shown as text
        typed = api(cluster, "POST", "/devices/alpha/commands", agent,
                    json={"commands": [{"tool_name": "type_text", "parameters": {"text": hostile}}]})
        assert typed.json()["results"][0]["status"] == "failure", typed.text
        expect(page.locator("#actions")).to_contain_text("<b>bold</b>")
        expect(page.locator("#actions b, #actions img")).to_have_count(0)
        # the person clicks Submit in the picture: it lands in the program, audited as the person
        box = img.bounding_box()
        assert box is not None
        scale = box["width"] / SCREEN_W
        img.click(position={"x": buttons["submit"][0] * scale, "y": buttons["submit"][1] * scale})
        in_thread(gui.wait_event("submit", via="button"))
        page.locator("#screen").press_sequentially("hi")  # keys typed in the view land too, in order
        page.locator("#screen").press("Enter")
        in_thread(gui.wait_event("submit", via="key", text="hi"))
        expect(page.locator(".mark.person").first).to_be_visible()  # the person's click, drawn in its colour
        assert len(gui.events("cancel")) == 1  # the refused click did nothing
        rows = audit_rows(cluster)
        assert any(r["tool_name"] == "click" and r["requested_by"] == "api:tests" and r["status"] == "success"
                   for r in rows), rows[:5]
        assert any(r["tool_name"] == "screen.take" for r in rows)
        # at 390 px wide the view fits: no sideways scrolling
        page.set_viewport_size({"width": 390, "height": 800})
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        person.shot("live-view-held-390")
        page.set_viewport_size({"width": 1280, "height": 800})
        # handing back lets the agent act again
        page.get_by_role("button", name="Hand back").click()
        expect(holder).to_contain_text("The agent has the desktop")
        assert agent_click(cluster, agent, buttons["cancel"])["status"] == "success"
        in_thread(gui.wait_count("cancel", 2))
        print(f"live view: {page.locator('#rate').inner_text().strip()}")
    finally:
        person.close()
    # a page that goes away while it holds the desktop releases it
    other = Dash(browser, cluster, cluster.api_token)
    open_view(other)
    other.page.get_by_role("button", name="Take over").click()
    expect(other.page.locator("#holder")).to_contain_text("Held by tests")
    assert agent_click(cluster, agent, buttons["cancel"])["status"] == "failure"
    other.close()
    wait_for(lambda: any(r["tool_name"] == "screen.hand_back" and "went away" in str(r.get("arguments"))
                         for r in audit_rows(cluster)), "the hold released when the page went away", 15)
    assert agent_click(cluster, agent, buttons["cancel"])["status"] == "success"
    in_thread(gui.wait_count("cancel", 3))
    rows = audit_rows(cluster)
    assert sum(r["tool_name"] == "screen.view" for r in rows) == 2
    assert sum(r["tool_name"] == "screen.view_end" for r in rows) == 2


def test_the_screen_is_for_execute_tokens_and_taking_over_for_persons(cluster: Cluster, agent: str) -> None:
    base = f"http://127.0.0.1:{cluster.port}/web/devices/alpha/screen"
    reader = httpx.get(base, headers={"Authorization": f"Bearer {cluster.read_token}"}, timeout=30)
    assert reader.status_code == 403 and "execute" in reader.json()["error"]
    nowhere = httpx.get(base.replace("alpha", "no-such"), headers={"Authorization": f"Bearer {agent}"}, timeout=30)
    assert nowhere.status_code == 404
    made = api(cluster, "POST", "/tokens", cluster.api_token,  # execute, but on another device only
               json={"kind": "api", "name": "beta-only", "scopes": ["execute"], "devices": ["beta"]})
    assert made.status_code == 201, made.text
    elsewhere = httpx.get(base, headers={"Authorization": f"Bearer {made.json()['token']}"}, timeout=30)
    assert elsewhere.status_code == 404, elsewhere.text
    taken = httpx.post(base + "/take", json={"stream": "x"}, headers={"Authorization": f"Bearer {agent}"}, timeout=30)
    assert taken.status_code == 403 and "person" in taken.json()["error"]
    stranger = httpx.post(base + "/act", json={"stream": "guess", "tool": "click", "parameters": {"x": 1, "y": 1}},
                          headers={"Authorization": f"Bearer {cluster.api_token}"}, timeout=30)
    assert stranger.status_code == 404

