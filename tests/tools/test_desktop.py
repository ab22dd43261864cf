"""Desktop tools against a real X server (Xvfb, started here) and a real Tk program (bench/kit/gui_app.py).

The program writes every click, submit and focus change as JSON lines to a FIFO the tests read as a
stream; tests wait on those events (and on a window's DestroyNotify), never on fixed sleeps or polling.
Xvfb, xdotool, xdpyinfo and xev are required: a machine without them fails with the command that installs
them. The pure parts (the ui.typeText token parser, key names, fuzzy label matching) are tested as tables
in test_desktop_text.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.kits.desktop import (
    GUI_APP,
    SCREEN,
    TITLE,
    EventLog,
    GuiApp,
    png,
    require_programs,
    running_xvfb,
    stop,
    watch_window,
)
from tests.kits.results import failed, ok
from tether.tools.context import ToolContext
from tether.tools.desktop.ocr import OcrEngine
from tether.tools.errors import MissingDependency
from tether.tools.policy.model import CommandRule, Policy
from tether.tools.runtime import ToolSet
from tether.tools.system.tool import system_toolset

# ------------------------------------------------------------------------------------------ X server and app


@pytest.fixture(scope="session")
def xvfb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_programs()
    with running_xvfb(tmp_path_factory.mktemp("xvfb") / "xvfb.log") as display:
        yield display


@pytest.fixture(scope="session")
def ocr_engine() -> OcrEngine:
    """One OCR engine for the whole run: loading the models once keeps the tests quick."""
    require_programs()
    engine = OcrEngine()
    engine.warm_up()
    return engine


@pytest.fixture
def desktop(xvfb: str, ocr_engine: OcrEngine) -> ToolSet:
    from tether.tools.desktop.tool import desktop_toolset

    return desktop_toolset(display=xvfb, ocr=ocr_engine, session_bus="")  # no accessibility bus: Tk has no tree


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    return ToolContext(policy=Policy(read_roots=[str(tmp_path)], write_roots=[str(tmp_path)]),
                       temp_dir=str(tmp_path))


@pytest.fixture
async def app(xvfb: str, tmp_path: Path) -> AsyncIterator[GuiApp]:
    log = EventLog(tmp_path / "events.jsonl")
    proc = subprocess.Popen([sys.executable, str(GUI_APP), str(log)], env={**os.environ, "DISPLAY": xvfb})
    gui = GuiApp(proc, log)
    try:
        await gui.wait_event("ready")
        yield gui
    finally:
        await stop(proc, xvfb, TITLE)


# ------------------------------------------------------------------------------------------ screen


async def test_screenshot_full_region_scaled_and_to_a_file(desktop: ToolSet, ctx: ToolContext, app: GuiApp,
                                                           tmp_path: Path) -> None:
    full = ok(await desktop.call("screenshot", {}, ctx))
    assert (full["width"], full["height"], full["scale"], full["format"]) == (*SCREEN, 1.0, "png")
    assert png(base64.b64decode(full["data"])).size == SCREEN
    assert full["bytes"] == len(base64.b64decode(full["data"]))

    part = ok(await desktop.call("screenshot", {"region": {"x": 10, "y": 20, "width": 300, "height": 200}}, ctx))
    assert png(base64.b64decode(part["data"])).size == (300, 200)
    assert part["captured"] == {"x": 10, "y": 20, "width": 300, "height": 200}
    clipped = ok(await desktop.call("screenshot", {"region": {"x": 1200, "y": 700, "width": 300, "height": 300}}, ctx))
    assert clipped["captured"] == {"x": 1200, "y": 700, "width": 80, "height": 100}
    failed(await desktop.call("screenshot", {"region": {"x": 5000, "y": 0, "width": 10, "height": 10}}, ctx),
           "outside")
    failed(await desktop.call("screenshot", {"region": {"x": 0, "y": 0, "width": 0, "height": 10}}, ctx), "width")

    half = ok(await desktop.call("screenshot", {"scale": 0.5}, ctx))
    assert (half["width"], half["height"]) == (640, 400)

    win = ok(await desktop.call("screenshot", {"activeWindow": True}, ctx))
    assert win["window"]["title"] == TITLE
    assert (win["width"], win["height"]) == (win["window"]["width"], win["window"]["height"])

    target = tmp_path / "shot.png"
    saved = ok(await desktop.call("screenshot", {"path": str(target)}, ctx))
    assert saved["path"] == str(target) and "data" not in saved
    assert png(target.read_bytes()).size == SCREEN and saved["bytes"] == target.stat().st_size
    failed(await desktop.call("screenshot", {"path": str(target)}, ctx), "already exists")
    failed(await desktop.call("screenshot", {"path": "/etc/tether-shot.png"}, ctx), "write_roots")


# ------------------------------------------------------------------------------------------ UI tree


async def test_ui_tree_finds_the_buttons_and_click_element_hits_the_right_one(desktop: ToolSet, ctx: ToolContext,
                                                                            app: GuiApp) -> None:
    tree = ok(await desktop.call("get_ui_tree", {}, ctx))
    assert tree["window_title"] == TITLE and tree["source"] == "ocr"
    assert "no accessibility bus" in tree["why_not_accessibility"]
    by_text = {e["text"]: e for e in tree["elements"]}
    assert {"Submit", "Cancel", "Show Later"} <= set(by_text), tree["elements"]
    win = tree["window"]
    for name in ("Submit", "Cancel"):
        box = by_text[name]["box"]
        assert box["width"] > 20 and box["height"] > 10 and by_text[name]["confidence"] > 0.8
        assert win["x"] <= box["x"] and box["x"] + box["width"] <= win["x"] + win["width"]
    assert by_text["Submit"]["box"]["x"] < by_text["Cancel"]["box"]["x"]

    clicked = ok(await desktop.call("click_element", {"control_id": by_text["Cancel"]["id"]}, ctx))
    assert clicked["clicked"]["text"] == "Cancel"
    await app.wait_event("cancel")
    assert app.events("submit") == []

    failed(await desktop.call("click_element", {"control_id": "t99_1"}, ctx), "valid ids", by_text["Submit"]["id"])
    newer = ok(await desktop.call("get_ui_tree", {"activeWindow": True}, ctx))
    assert newer["tree"] == tree["tree"] + 1 and newer["captured"]["width"] == win["width"]
    failed(await desktop.call("click_element", {"control_id": by_text["Submit"]["id"]}, ctx),
           f"from UI tree {tree['tree']}", "latest")
    assert app.events("submit") == []


async def test_ocr_reuses_the_answer_for_an_unchanged_frame(xvfb: str, app: GuiApp) -> None:
    from tether.tools.desktop.screen import grab_sync

    engine = OcrEngine()
    area = {"x": 0, "y": 120, "width": 700, "height": 100}  # the buttons, not the blinking caret
    first = await asyncio.to_thread(engine.recognize, grab_sync(xvfb, area), "a")
    again = await asyncio.to_thread(engine.recognize, grab_sync(xvfb, area), "b")
    assert engine.reused == 1 and "Submit" in [e.text for e in first]
    assert [(e.text, e.box) for e in again] == [(e.text, e.box) for e in first] and again[0].id == "b1"
    other = {**area, "x": 1}
    await asyncio.to_thread(engine.recognize, grab_sync(xvfb, other))
    assert engine.reused == 1  # another region is never served from the cache
    fresh = OcrEngine(reuse_unchanged=False)
    for _ in range(2):
        await asyncio.to_thread(fresh.recognize, grab_sync(xvfb, area))
    assert fresh.reused == 0


async def test_click_element_needs_a_tree_first(desktop: ToolSet, ctx: ToolContext) -> None:
    failed(await desktop.call("click_element", {"control_id": "t1_1"}, ctx), "call get_ui_tree first")


# ------------------------------------------------------------------------------------------ ui.findAndClick


async def test_find_and_click_clicks_the_label(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    res = ok(await desktop.call("ui.findAndClick", {"label": "Submit"}, ctx))
    assert res["clicked"]["text"] == "Submit" and res["score"] == 1.0 and res["window_title"] == TITLE
    box, centre = res["clicked"]["box"], res["clicked"]["center"]
    assert box["x"] <= centre["x"] <= box["x"] + box["width"]
    await app.wait_event("submit", via="button")


async def test_find_and_click_fuzzy_and_inside_an_app(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    res = ok(await desktop.call("ui.findAndClick", {"label": "Submt", "confidence": 0.7}, ctx))
    assert res["clicked"]["text"] == "Submit" and 0.7 <= res["score"] < 1
    await app.wait_event("submit")
    ok(await desktop.call("ui.findAndClick", {"label": "cancel", "app": "tether test"}, ctx))
    await app.wait_event("cancel")
    failed(await desktop.call("ui.findAndClick", {"label": "Cancel", "app": "No Such App", "timeoutMs": 0}, ctx),
           "no visible window", TITLE)


async def test_find_and_click_without_a_match_lists_candidates(desktop: ToolSet, ctx: ToolContext,
                                                               app: GuiApp) -> None:
    started = time.monotonic()
    res = await desktop.call("ui.findAndClick", {"label": "Nonexistent", "timeoutMs": 1000}, ctx)
    assert time.monotonic() - started >= 1.0
    failed(res, "no text matching 'Nonexistent'", "closest", "'Submit'")
    candidates = res.result["candidates"]
    assert 3 <= len(candidates) <= 5 and {"Submit", "Cancel", "Show Later"} <= {c["text"] for c in candidates}
    assert candidates == sorted(candidates, key=lambda c: -c["score"])
    assert app.events("submit") == [] and app.events("cancel") == []


# ------------------------------------------------------------------------------------------ typing


async def test_type_text_with_tab_and_enter(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    await app.wait_event("focus", widget="entry")
    res = ok(await desktop.call("ui.typeText", {"text": "hello{TAB}", "delayMs": 10}, ctx))
    assert res["typed_chars"] == 5 and res["keys"] == ["Tab"]
    await app.wait_event("focus", widget="submit")  # Tab moved the focus from the field to the button
    ok(await desktop.call("ui.typeText", {"text": "{ENTER}"}, ctx))
    assert (await app.wait_event("submit", via="key"))["text"] == "hello"
    failed(await desktop.call("ui.typeText", {"text": "oops{NOPE}"}, ctx), "nothing was typed", "NOPE")


async def test_type_text_literal_and_press_key(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    await app.wait_event("focus", widget="entry")
    ok(await desktop.call("type_text", {"text": "{literal} -x"}, ctx))
    ok(await desktop.call("press_key", {"key": "Enter"}, ctx))
    assert (await app.wait_event("submit", via="key"))["text"] == "{literal} -x"
    failed(await desktop.call("press_key", {"key": "NoSuchKey"}, ctx), "unknown key")


async def test_click_and_scroll_check_the_screen(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    failed(await desktop.call("click", {"x": 5000, "y": 10}, ctx), "outside")
    ok(await desktop.call("scroll", {"direction": "down", "amount": 2, "x": 300, "y": 300}, ctx))
    failed(await desktop.call("scroll", {"direction": "down", "x": 300}, ctx), "both x and y")
    tree = ok(await desktop.call("get_ui_tree", {}, ctx))
    cancel = next(e for e in tree["elements"] if e["text"] == "Cancel")
    cx, cy = cancel["box"]["x"] + cancel["box"]["width"] // 2, cancel["box"]["y"] + cancel["box"]["height"] // 2
    ok(await desktop.call("click", {"x": cx, "y": cy}, ctx))
    await app.wait_event("cancel")


# ------------------------------------------------------------------------------------------ ui.waitFor


async def test_wait_for_text_that_appears_later(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    ok(await desktop.call("ui.findAndClick", {"label": "Show Later"}, ctx))
    res = ok(await desktop.call("ui.waitFor", {"condition": "textIncludes", "value": "Build succeeded",
                                               "timeoutMs": 60000, "pollIntervalMs": 200}, ctx))
    shown = app.events("shown")
    assert shown, "waitFor reported the text before the program showed it"
    assert res["met"] and res["seen"]["elements"][0]["text"] == "Build succeeded"
    regex = ok(await desktop.call("ui.waitFor", {"condition": "textRegex", "value": r"Build \w+ed"}, ctx))
    assert regex["seen"]["match"] == "Build succeeded"
    failed(await desktop.call("ui.waitFor", {"condition": "textRegex", "value": "("}, ctx), "invalid regular")


async def test_wait_for_timeout_says_what_it_saw(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    started = time.monotonic()
    res = await desktop.call("ui.waitFor", {"condition": "textIncludes", "value": "Never There",
                                            "timeoutMs": 1500, "pollIntervalMs": 300}, ctx)
    assert time.monotonic() - started >= 1.5
    failed(res, "not met within 1500 ms", "last saw", "Submit")
    assert "Cancel" in res.result["last_seen"]["text"] and res.result["polls"] >= 1


async def test_wait_for_window_conditions(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    active = ok(await desktop.call("ui.waitFor", {"condition": "appIsActive", "value": "TetherTestApp"}, ctx))
    assert active["seen"]["title"] == TITLE
    ok(await desktop.call("ui.waitFor", {"condition": "titleIncludes", "value": "test app"}, ctx))
    ok(await desktop.call("ui.waitFor", {"condition": "urlIncludes", "value": "Tether Test"}, ctx))
    failed(await desktop.call("ui.waitFor", {"condition": "titleIncludes", "value": "Other Program",
                                             "timeoutMs": 300, "pollIntervalMs": 100}, ctx), "last saw", TITLE)
    failed(await desktop.call("ui.waitFor", {"condition": "appIsActive", "value": ""}, ctx), "non-empty")


async def test_wait_for_changed(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    tree = ok(await desktop.call("get_ui_tree", {}, ctx))
    later = next(e for e in tree["elements"] if e["text"] == "Show Later")
    unchanged = await desktop.call("ui.waitFor", {"condition": "changed", "timeoutMs": 300, "pollIntervalMs": 100},
                                   ctx)
    failed(unchanged, "not met", "changed_fraction")
    waiting = asyncio.create_task(desktop.call("ui.waitFor", {"condition": "changed", "timeoutMs": 15000,
                                                              "pollIntervalMs": 100}, ctx))
    ok(await desktop.call("click_element", {"control_id": later["id"]}, ctx))  # the label appears 1 s later
    res = ok(await waiting)
    assert res["seen"]["changed_fraction"] > 0.001
    await app.wait_event("shown")


# ------------------------------------------------------------------------------------------ windowed programs


async def test_launch_reports_the_window_and_close_closes_it(xvfb: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPLAY", xvfb)  # launch_application's programs inherit the device's display
    exe = Path(sys.executable)
    policy = Policy(read_roots=[str(tmp_path), str(GUI_APP.parent)], write_roots=[str(tmp_path)],
                    commands={exe.name: CommandRule()})
    sctx = ToolContext(policy=policy, temp_dir=str(tmp_path))
    system = system_toolset()
    log = tmp_path / "launched.jsonl"
    title = "Launched Tether App"
    res = ok(await system.call("launch_application", {
        "app_name": str(exe), "args": [str(GUI_APP), str(log), "--title", title, "--geometry", "500x300+700+450"],
        "cwd": str(tmp_path), "waitForWindowMs": 15000}, sctx))
    pid = res["pid"]
    try:
        window = res["window"]
        assert window is not None, res
        assert window["title"] == title and window["matched_by"] in ("pid", "new window")
        assert (window["width"], window["height"]) == (500, 300)
        gone = await watch_window(xvfb, title)
        closed = ok(await system.call("close_application", {"pid": pid}, sctx))
        assert pid in closed["closed"]
        await gone.wait("the launched window to close")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    quick = ok(await system.call("launch_application", {"app_name": "true", "waitForWindowMs": 5000},
                                 ToolContext(policy=Policy(commands={"true": CommandRule()}))))
    assert quick["window"] is None and "exited" in quick["window_note"]


# ------------------------------------------------------------------------------------------ absent


def test_without_a_display_the_tool_set_says_what_is_missing(xvfb: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.tools.desktop.tool import desktop_toolset
    from tether.tools.toolsets.builtin import builtin_toolsets

    with pytest.raises(MissingDependency, match="no X display: set DISPLAY or run under Xvfb"):
        desktop_toolset(display="")
    with pytest.raises(MissingDependency, match="cannot open X display ':4711'"):
        desktop_toolset(display=":4711")
    monkeypatch.delenv("DISPLAY", raising=False)
    with pytest.raises(MissingDependency, match="set DISPLAY"):
        builtin_toolsets()["desktop"]()
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MissingDependency, match="apt-get install xdotool"):
        desktop_toolset(display=xvfb)


async def test_tool_names_and_closing(desktop: ToolSet, ocr_engine: OcrEngine, xvfb: str) -> None:
    from tether.tools.desktop.tool import desktop_toolset
    from tether.tools.toolsets.builtin import OPTIONAL_TOOLS

    assert set(desktop.specs) == set(OPTIONAL_TOOLS["desktop"]) | {"screenshot"}
    kinds = {name: spec.tool_type for name, spec in desktop.specs.items()}
    assert {n for n, k in kinds.items() if k == "data_collection"} == {"screenshot", "get_ui_tree", "ui.waitFor"}
    await desktop.aclose()
    assert ocr_engine._engine is not None  # a shared engine belongs to whoever passed it in
    await desktop_toolset(display=xvfb).aclose()
