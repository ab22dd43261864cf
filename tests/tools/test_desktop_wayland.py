"""Wayland: a real headless sway driven by the desktop tools (grim screenshots, tether's own virtual pointer
and keyboard client, swaymsg windows) with a real GTK 3 program on it (GDK_BACKEND=wayland) and on a
private AT-SPI bus; what the compositor offers (read from its globals); and the refusal of compositors
the tools do not drive.

A headless seat has no input devices until a client adds one, and a client may miss the first event of a
device that just appeared; a real seat always has its keyboard and mouse. So, like a real seat, the
module holds one virtual keyboard and pointer from before the program starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kits.desktop import (
    GTK_APP,
    SYSTEM_PYTHON,
    EventLog,
    GuiApp,
    require_a11y,
    running_session_bus,
    running_sway,
)
from tests.kits.results import ok
from tether.tools.context import ToolContext
from tether.tools.desktop.ocr import OcrEngine
from tether.tools.desktop.wayland import WaylandSession, probe_wayland, session_facts, wayland_refusal
from tether.tools.desktop.wlinput import WlInput
from tether.tools.errors import MissingDependency
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet

TITLE = "Tether GTK App"


@pytest.fixture(scope="module")
def sway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], str, Path]]:
    """sway's client environment, a private session bus, and a folder for the program's log."""
    require_a11y()
    tmp = tmp_path_factory.mktemp("wl")
    with running_sway() as env, running_session_bus(None, tmp / "run") as bus:
        seat = WlInput(os.path.join(env["XDG_RUNTIME_DIR"], env["WAYLAND_DISPLAY"])).open()
        try:
            yield env, bus, tmp
        finally:
            seat.close()


@pytest.fixture(scope="module")
def gtk_proc(sway: tuple[dict[str, str], str, Path]) -> Iterator[tuple[subprocess.Popen[bytes], EventLog]]:
    env, bus, tmp = sway
    log = EventLog(tmp / "events.jsonl")
    app_env = {**os.environ, **env, "GDK_BACKEND": "wayland", "DBUS_SESSION_BUS_ADDRESS": bus}
    app_env.pop("DISPLAY", None)
    proc = subprocess.Popen([SYSTEM_PYTHON, str(GTK_APP), str(log), "--title", TITLE], env=app_env)
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


@pytest.fixture
async def desktop(sway: tuple[dict[str, str], str, Path], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ToolSet]:
    from tether.tools.desktop.tool import desktop_toolset

    env, bus, _tmp = sway
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DISPLAY", raising=False)
    tools = desktop_toolset(ocr=OcrEngine(), session_bus=bus)
    yield tools
    await tools.aclose()


@pytest.fixture
def ctx() -> ToolContext:
    return ToolContext(policy=Policy())


def by_name(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in tree["elements"] if e["name"]}


def test_what_sway_offers_and_the_profile_says(sway: tuple[dict[str, str], str, Path]) -> None:
    env = sway[0]
    session = probe_wayland(env)
    assert session is not None and session.compositor == "sway"
    assert session.features == {"screenshots": True, "keyboard input": True, "pointer input": True,
                                "window list": True}
    assert probe_wayland({**env, "WAYLAND_DISPLAY": "wayland-404"}) is None  # nobody listens there
    facts = session_facts(env)  # no DISPLAY: a pure Wayland session, driven through sway
    assert facts["backend"] == "wayland" and facts["desktop_tools"].startswith("sway: screenshots (grim)")
    assert session_facts({**env, "DISPLAY": ":0"})["backend"] == "xwayland"
    assert session_facts({"DISPLAY": ":0"})["backend"] == "x11" and session_facts({})["backend"] is None
    other = session_facts({k: v for k, v in env.items() if k != "SWAYSOCK"})  # a wlroots compositor, not sway
    assert "drive X11 displays and sway only" in other["desktop_tools"] and "not sway" in other["desktop_tools"]


async def test_screenshots_windows_and_the_tree_on_sway(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    shot = ok(await desktop.call("screenshot", {}, ctx))
    assert (shot["width"], shot["height"]) == (1280, 800) and shot["frame"].startswith("f")
    win = ok(await desktop.call("screenshot", {"activeWindow": True}, ctx))
    assert win["window"]["title"] == TITLE and win["window"]["pid"] == app.proc.pid
    tree = ok(await desktop.call("get_ui_tree", {}, ctx))
    assert tree["source"] == "accessibility" and tree["matched_by"].startswith("the active X11 window (pid")
    submits = len(app.events("submit"))
    pressed = ok(await desktop.call("click_element", {"control_id": by_name(tree)["Submit"]["id"],
                                                      "frame": tree["frame"]}, ctx))
    assert pressed["via"] == "accessibility" and pressed["frame_check"]["unchanged"]
    await app.wait_count("submit", submits + 1)


async def test_pointer_and_keyboard_on_sway(desktop: ToolSet, ctx: ToolContext, app: GuiApp) -> None:
    # the entry has the focus since the program started (pressing through AT-SPI does not move it)
    typed = ok(await desktop.call("ui.typeText", {"text": "oops{CTRL+A}hello wayland!", "delayMs": 0}, ctx))
    assert typed["keys"] == ["ctrl+a"]
    entry = by_name(ok(await desktop.call("get_ui_tree", {}, ctx)))["Message"]
    assert entry["text"] == "hello wayland!"  # typed by the virtual keyboard, read back through AT-SPI

    cancels = len(app.events("cancel"))
    clicked = ok(await desktop.call("ui.findAndClick", {"label": "Cancel", "via": "ocr", "app": TITLE}, ctx))
    assert clicked["via"] == "ocr" and clicked["window_title"] == TITLE
    await app.wait_count("cancel", cancels + 1)  # grim's pixels, OCR, and the virtual pointer agree


def test_a_compositor_that_allows_nothing_is_named_as_such() -> None:
    gnome = WaylandSession("/run/user/1000/wayland-0", {"wl_seat": 9, "gtk_shell1": 5}, "GNOME (mutter)",
                           {"screenshots": False, "keyboard input": False, "pointer input": False,
                            "window list": False})
    said = wayland_refusal(gnome)
    assert "GNOME (mutter)" in said and "lets no ordinary client" in said and "portal and libei" in said


def test_the_tools_refuse_a_wayland_session_they_do_not_drive(sway: tuple[dict[str, str], str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.tools.desktop.tool import desktop_toolset

    for key, value in sway[0].items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("SWAYSOCK")
    with pytest.raises(MissingDependency, match=r"it offers screenshots, keyboard input, pointer input.*not sway"):
        desktop_toolset()


async def test_a_sandboxed_launch_reaches_sway_and_its_window_is_reported(
        sway: tuple[dict[str, str], str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """launch_application on a sway session: the program, confined, reaches the compositor's socket (and no
    other), and its window is found through sway's tree by the program's pid."""
    import tempfile

    from tether.device.local import build_device
    from tether.tools.policy.model import policy_from_mapping
    from tether.tools.system.tool import system_toolset

    env, _bus, _tmp = sway
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DISPLAY", raising=False)
    home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-wl-home-")).resolve()
    monkeypatch.setenv("HOME", str(home))
    state = home / ".local/state/tether"
    state.mkdir(parents=True)
    # the compositor runs as `nobody` here (sway refuses root), its runtime folder closed to others; on a
    # desktop the device and the compositor are one user: open the way to the socket to stand for that
    os.chmod(env["XDG_RUNTIME_DIR"], 0o711)
    os.chmod(os.path.join(env["XDG_RUNTIME_DIR"], env["WAYLAND_DISPLAY"]), 0o777)
    out = home / "launched"
    out.mkdir()
    log = out / "events.jsonl"
    device = build_device(policy=policy_from_mapping({
        "commands": {"python3": {}}, "require_sandbox": True,
        "read_roots": [str(GTK_APP.parent), str(log.parent)], "live_write_roots": [str(log.parent)]}),
        state_dir=state, sandbox=True)
    assert device.context.sandbox is not None, "no sandbox was made here (see the log for why)"
    title = "Launched On Sway"
    pid = 0
    try:
        result = await system_toolset().call("launch_application", {
            "app_name": SYSTEM_PYTHON, "args": [str(GTK_APP), str(log), "--title", title],
            "cwd": str(log.parent), "waitForWindowMs": 20000}, device.context)
        assert result.ok, result
        pid = result.result["pid"]
        window = result.result["window"]
        assert result.result["sandbox"] != "none" and window is not None, result.result
        assert window["title"] == title and window["matched_by"] in ("pid", "new window"), window
        system = system_toolset()
        closed = await system.call("close_application", {"pid": pid}, device.context)
        assert closed.ok and pid in closed.result["closed"], closed
    finally:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        await device.aclose()
        shutil.rmtree(home, ignore_errors=True)
