"""Wayland: what a real headless sway offers (read from its globals by tether's own Wayland client), the
device profile's account of the session, and the desktop tools' refusal naming what the compositor allows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kits.desktop import running_sway
from tether.tools.desktop.wayland import WaylandSession, probe_wayland, session_facts, wayland_refusal
from tether.tools.optional import MissingDependency


@pytest.fixture(scope="module")
def sway() -> Iterator[dict[str, str]]:
    with running_sway() as env:
        yield env


def test_a_wlroots_compositor_offers_screenshots_and_input(sway: dict[str, str]) -> None:
    session = probe_wayland(sway)
    assert session is not None and session.compositor == "sway"
    assert session.features == {"screenshots": True, "keyboard input": True, "pointer input": True,
                                "window list": True}
    assert "wl_seat" in session.globals and session.socket.endswith("/wayland-1")
    assert probe_wayland({**sway, "WAYLAND_DISPLAY": "wayland-404"}) is None  # nobody listens there

    facts = session_facts(sway)  # no DISPLAY: a pure Wayland session
    assert facts["backend"] == "wayland" and facts["wayland"]["compositor"] == "sway"
    assert "drive X11 displays only" in facts["desktop_tools"]
    assert session_facts({**sway, "DISPLAY": ":0"})["backend"] == "xwayland"
    assert session_facts({"DISPLAY": ":0"})["backend"] == "x11"
    assert session_facts({})["backend"] is None


def test_the_desktop_tools_refuse_a_wayland_session_saying_what_it_allows(
        sway: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.tools.desktop.tool import desktop_toolset

    for key, value in sway.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DISPLAY", raising=False)
    with pytest.raises(MissingDependency, match=r"Wayland session \(sway; it offers screenshots, keyboard input"):
        desktop_toolset()


def test_a_compositor_that_allows_nothing_is_named_as_such() -> None:
    gnome = WaylandSession("/run/user/1000/wayland-0", {"wl_seat": 9, "gtk_shell1": 5}, "GNOME (mutter)",
                           {"screenshots": False, "keyboard input": False, "pointer input": False,
                            "window list": False})
    said = wayland_refusal(gnome)
    assert "GNOME (mutter)" in said and "lets no ordinary client" in said and "portal and libei" in said
