"""The accessibility tree (AT-SPI) and frames, against a real GTK 3 program on a real accessibility bus.

One Xvfb, one private D-Bus session bus (whose org.a11y.Bus starts a private at-spi2 bus and registry)
and one GTK program (bench/kit/gtk_app.py, run by Debian's Python with python3-gi) serve the module.
The program writes every click, submit and toggle to a FIFO the tests read as a stream: they wait on
those events, never on sleeps. It reports `ready` only once the accessibility registry lists it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits.desktop import (
    GTK_APP,
    SYSTEM_PYTHON,
    EventLog,
    GuiApp,
    require_a11y,
    require_programs,
    running_session_bus,
    running_xvfb,
    xdo,
)
from tests.kits.results import failed, ok
from tether.tools.context import ToolContext
from tether.tools.desktop.ocr import OcrEngine
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet

TITLE = "Tether GTK App"


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """Xvfb, a private session bus and the GTK program: (display, session bus address, event log path)."""
    require_programs()
    require_a11y()
    tmp = tmp_path_factory.mktemp("a11y")
    with running_xvfb(tmp / "xvfb.log") as display, running_session_bus(display, tmp / "run") as bus:
        yield display, bus, tmp


@pytest.fixture(scope="module")
def gtk_proc(session: tuple[str, str, Path]) -> Iterator[tuple[subprocess.Popen[bytes], EventLog]]:
    display, bus, tmp = session
    log = EventLog(tmp / "events.jsonl")
    env = {**os.environ, "DISPLAY": display, "DBUS_SESSION_BUS_ADDRESS": bus, "XDG_RUNTIME_DIR": str(tmp / "run")}
    env.pop("AT_SPI_BUS_ADDRESS", None)
    proc = subprocess.Popen([SYSTEM_PYTHON, str(GTK_APP), str(log), "--title", TITLE], env=env)
    try:
        yield proc, log
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture
async def app(gtk_proc: tuple[subprocess.Popen[bytes], EventLog]) -> GuiApp:
    gui = GuiApp(*gtk_proc)
    await gui.wait_event("ready", timeout=30)
    return gui


@pytest.fixture(scope="module")
def ocr_engine() -> OcrEngine:
    return OcrEngine()


@pytest.fixture
def desktop(session: tuple[str, str, Path], ocr_engine: OcrEngine) -> ToolSet:
    from tether.tools.desktop.tool import desktop_toolset

    return desktop_toolset(display=session[0], ocr=ocr_engine, session_bus=session[1])


@pytest.fixture
def ctx() -> ToolContext:
    return ToolContext(policy=Policy())


def by_name(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in tree["elements"] if e["name"]}


async def test_the_tree_lists_the_controls_with_stable_ids(desktop: ToolSet, ctx: ToolContext, app: GuiApp,
                                                          session: tuple[str, str, Path]) -> None:
    xdo(session[0], "mousemove", "300", "300")  # no window manager: the active window is the one under the pointer
    tree = ok(await desktop.call("get_ui_tree", {}, ctx))
    assert tree["matched_by"] == "the active X11 window (pid and title)", tree["matched_by"]
    assert tree["source"] == "accessibility" and tree["window_title"] == TITLE, tree
    assert tree["application"]["pid"] == app.proc.pid and tree["frame"].startswith("f")
    named = by_name(tree)
    for label in ("Submit", "Cancel", "Show Later"):
        assert named[label]["role"] == "push button" and "Click" in named[label]["actions"]
        assert {"enabled", "showing"} <= set(named[label]["states"])
    entry, check = named["Message"], named["Remember me"]
    assert entry["role"] == "text" and entry["editable"] and "editable" in entry["states"]
    assert check["role"] == "check box"
    window = tree["window"]["bounds"]
    for element in (entry, named["Submit"], check):
        b = element["bounds"]
        assert window["x"] <= b["x"] and b["x"] + b["width"] <= window["x"] + window["width"] and b["height"] > 10
    assert named["Submit"]["bounds"]["x"] < named["Cancel"]["bounds"]["x"]

    again = ok(await desktop.call("get_ui_tree", {"app": "tether gtk"}, ctx))
    assert again["matched_by"] == "named" and by_name(again)["Submit"]["id"] == named["Submit"]["id"]
    failed(await desktop.call("get_ui_tree", {"app": "No Such Program", "source": "accessibility"}, ctx),
           "no accessibility tree", "No Such Program")


async def test_a_button_is_pressed_by_id_and_by_role_and_name(desktop: ToolSet, ctx: ToolContext,
                                                             app: GuiApp) -> None:
    tree = ok(await desktop.call("get_ui_tree", {}, ctx))
    named = by_name(tree)
    before = len(app.events("submit"))
    res = ok(await desktop.call("click_element", {"control_id": named["Submit"]["id"]}, ctx))
    assert res["via"] == "accessibility" and res["action"] == "Click"
    assert res["frame_check"]["checked"] is False and "no frame named" in res["frame_check"]["note"]
    await app.wait_event("submit", count=before + 1)

    cancels = len(app.events("cancel"))
    ok(await desktop.call("click_element", {"role": "button", "name": "cancel"}, ctx))
    await app.wait_count("cancel", cancels + 1)
    toggled = ok(await desktop.call("click_element", {"role": "check box", "name": "Remember me"}, ctx))
    assert toggled["via"] == "accessibility"
    await app.wait_event("toggled", active=True)

    failed(await desktop.call("click_element", {"role": "button", "name": "Nowhere"}, ctx),
           "no element", "'Submit'")
    failed(await desktop.call("click_element", {"control_id": "a9999.9-42"}, ctx), "gone or unreadable")
    failed(await desktop.call("click_element", {"control_id": named["Submit"]["id"], "action": "Explode"}, ctx),
           "no action 'Explode'")


async def test_text_typed_into_the_entry_is_read_back(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    res = ok(await desktop.call("type_text", {"text": "hello", "role": "text", "name": "Message", "replace": True},
                                ctx))
    assert res["via"] == "accessibility" and res["text_now"] == "hello"
    more = ok(await desktop.call("type_text", {"text": " a11y", "control_id": res["element"]["id"]}, ctx))
    assert more["text_now"] == "hello a11y"
    entry = by_name(ok(await desktop.call("get_ui_tree", {}, ctx)))["Message"]
    assert entry["text"] == "hello a11y"
    before = len(app.events("submit"))
    ok(await desktop.call("ui.findAndClick", {"label": "Submit"}, ctx))
    assert (await app.wait_event("submit", count=before + 1))["text"] == "hello a11y"


async def test_find_and_click_uses_the_tree_and_ocr_on_request(desktop: ToolSet, ctx: ToolContext,
                                                              app: GuiApp) -> None:
    before = len(app.events("cancel"))
    res = ok(await desktop.call("ui.findAndClick", {"label": "Cancl", "confidence": 0.7}, ctx))
    assert res["via"] == "accessibility" and res["element"]["name"] == "Cancel" and res["score"] < 1
    await app.wait_count("cancel", before + 1)
    ocr = ok(await desktop.call("ui.findAndClick", {"label": "Cancel", "via": "ocr", "app": TITLE}, ctx))
    assert ocr["via"] == "ocr" and ocr["clicked"]["text"] == "Cancel"
    await app.wait_count("cancel", before + 2)


async def test_an_action_on_a_stale_frame_is_refused(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    shot = ok(await desktop.call("screenshot", {}, ctx))
    submit = by_name(ok(await desktop.call("get_ui_tree", {}, ctx)))["Submit"]
    shown = len(app.events("shown"))
    ok(await desktop.call("click_element", {"role": "button", "name": "Show Later"}, ctx))
    text = (await app.wait_count("shown", shown + 1))["text"]
    submits = len(app.events("submit"))
    res = await desktop.call("click_element", {"control_id": submit["id"], "frame": shot["frame"]}, ctx)
    failed(res, f"frame {shot['frame']} is stale", "take a new screenshot")
    # whether Submit's point lies inside the change depends on what else the first picture caught still being
    # drawn (under load, the whole window): the refusal says which, as a bool
    assert res.result["stale"] and isinstance(res.result["point_inside"], bool)
    assert text.split()[1] in (res.result["text_after"] or ""), res.result
    failed(await desktop.call("click", {"x": 10, "y": 10, "frame": "f99999"}, ctx), "unknown frame")

    fresh = ok(await desktop.call("screenshot", {}, ctx))
    done = ok(await desktop.call("click_element", {"control_id": submit["id"], "frame": fresh["frame"]}, ctx))
    assert done["frame_check"] == {"checked": True, "frame": fresh["frame"], "unchanged": True}
    await app.wait_event("submit", count=submits + 1)
    assert len(app.events("submit")) == submits + 1  # the refused click never reached the program
