"""What a Wayland session allows: the compositor's globals, read with a minimal pure-Python Wayland client.

On Wayland a client can only take screenshots or send input through protocols the compositor chooses to
offer: wlroots compositors (sway, Hyprland, river, labwc) offer screencopy, a virtual keyboard and a
virtual pointer; GNOME (mutter) and KDE (KWin) offer none of them to ordinary clients, only the desktop
portal and libei. `probe_wayland()` connects to the compositor, lists its globals (wl_registry, one
round trip ended by wl_display.sync) and says which of those it has. The device profile uses it to tell
what kind of session a device has, and the desktop tools why they refuse one: they drive X11 (and
XWayland) displays and sway (`sway`, `wlinput`).

The wire format: every message is (object id: u32, size << 16 | opcode: u32, arguments), little-endian
on every platform Wayland runs on; a string is its length with the NUL, the bytes, padding to 4.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

PROBE_TIMEOUT_S = 3.0
SWAY_PROGRAMS = ("swaymsg", "grim")
# the protocols that make each kind of control possible, by global interface name
FEATURES: dict[str, tuple[str, ...]] = {
    "screenshots": ("zwlr_screencopy_manager_v1", "ext_image_copy_capture_manager_v1"),
    "keyboard input": ("zwp_virtual_keyboard_manager_v1",),
    "pointer input": ("zwlr_virtual_pointer_manager_v1",),
    "window list": ("zwlr_foreign_toplevel_manager_v1", "ext_foreign_toplevel_list_v1"),
}
_FAMILIES = (("gtk_shell1", "GNOME (mutter)"), ("org_kde_plasma_shell", "KDE (KWin)"),
             ("org_kde_kwin_blur_manager", "KDE (KWin)"), ("zwlr_layer_shell_v1", "a wlroots compositor"))


@dataclass(frozen=True, slots=True)
class WaylandSession:
    """One compositor's answer: its socket, its globals and what they allow."""

    socket: str
    globals: dict[str, int]
    compositor: str
    features: dict[str, bool] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"socket": self.socket, "compositor": self.compositor, "features": self.features}


def wayland_socket(env: dict[str, str] | None = None) -> str | None:
    """The compositor's socket path from $WAYLAND_DISPLAY (relative to $XDG_RUNTIME_DIR), or None."""
    env = env if env is not None else dict(os.environ)
    name = env.get("WAYLAND_DISPLAY")
    if not name:
        return None
    if os.path.isabs(name):
        return name
    runtime = env.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, name) if runtime else None


def _string(data: bytes, at: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<I", data, at)
    text = data[at + 4:at + 4 + max(0, length - 1)].decode(errors="replace")
    return text, at + 4 + (length + 3) // 4 * 4


def list_globals(path: str, timeout: float = PROBE_TIMEOUT_S) -> dict[str, int]:
    """The compositor's globals (interface name -> version): wl_display.get_registry, then sync, and the
    wl_registry.global events that come before the sync's done. An OSError when it cannot be asked."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        # wl_display (id 1): get_registry(new_id 2) is opcode 1, sync(new_id 3) is opcode 0
        sock.sendall(struct.pack("<III", 1, 12 << 16 | 1, 2) + struct.pack("<III", 1, 12 << 16 | 0, 3))
        found: dict[str, int] = {}
        buf = b""
        while True:
            while len(buf) < 8 or len(buf) < (struct.unpack_from("<I", buf, 4)[0] >> 16):
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("the compositor closed the connection")
                buf += chunk
            obj, word = struct.unpack_from("<II", buf)
            size, opcode = word >> 16, word & 0xFFFF
            body, buf = buf[8:size], buf[size:]
            if obj == 2 and opcode == 0:  # wl_registry.global(name, interface, version)
                interface, at = _string(body, 4)
                found[interface] = struct.unpack_from("<I", body, at)[0]
            elif obj == 3 and opcode == 0:  # wl_callback.done: every global was sent before it
                return found
            elif obj == 1 and opcode == 0:  # wl_display.error
                message, _ = _string(body, 8)
                raise OSError(f"the compositor reported an error: {message}")


def probe_wayland(env: dict[str, str] | None = None) -> WaylandSession | None:
    """The Wayland session named by the environment and what it allows, or None when there is none
    (or it cannot be reached: the answer is about what the tools can use)."""
    env = env if env is not None else dict(os.environ)
    path = wayland_socket(env)
    if path is None:
        return None
    try:
        found = list_globals(path)
    except OSError:
        return None
    compositor = "sway" if env.get("SWAYSOCK") else next((n for g, n in _FAMILIES if g in found), "unknown")
    features = {what: any(g in found for g in needs) for what, needs in FEATURES.items()}
    return WaylandSession(path, found, compositor, features)


def wayland_refusal(session: WaylandSession, why: str | None = None) -> str:
    """Why the desktop tools do not run on this Wayland session, saying what the compositor offers
    (`why`: what keeps the sway backend from driving it)."""
    offered = [what for what, ok in session.features.items() if ok]
    if not offered:
        return (f"this is a Wayland session ({session.compositor}) whose compositor lets no ordinary client take "
                "screenshots or send input (only the desktop portal and libei, which tether does not speak yet); "
                "the desktop tools need an X11 display: set DISPLAY to an XWayland or Xvfb display")
    return (f"this is a Wayland session ({session.compositor}; it offers {', '.join(offered)}), and tether's "
            f"desktop tools drive X11 displays and sway only{': ' + why if why else ''}; set DISPLAY to its "
            "XWayland display (X11 apps only) or run the apps under Xvfb")


def session_facts(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The graphical session for a device profile: `backend` ("x11", "xwayland": X11 under a Wayland
    session, only X11 windows seen and driven; "wayland": no X display, the tools refuse; or None),
    the Wayland compositor and what it offers when there is one, and `desktop_tools`: "x11" or why not."""
    env = env if env is not None else dict(os.environ)
    wayland = probe_wayland(env)
    display = env.get("DISPLAY") or None
    facts: dict[str, Any] = {"display": display, "wayland": wayland.as_dict() if wayland else None}
    if display:
        facts["backend"] = "xwayland" if wayland or env.get("XDG_SESSION_TYPE") == "wayland" else "x11"
        facts["desktop_tools"] = "x11" if facts["backend"] == "x11" else \
            "x11 through XWayland: windows of native Wayland apps are not seen or driven"
    elif wayland:
        facts["backend"] = "wayland"
        why = sway_problem(env)
        facts["desktop_tools"] = "sway: screenshots (grim), pointer and keyboard (virtual devices), windows " \
            "(swaymsg)" if why is None else wayland_refusal(wayland, why)
    else:
        facts["backend"] = None
        facts["desktop_tools"] = "no graphical session (neither DISPLAY nor WAYLAND_DISPLAY)"
    return facts


def sway_problem(env: dict[str, str] | None = None) -> str | None:
    """Why the desktop tools cannot drive this environment's sway session, or None when they can."""
    env = env if env is not None else dict(os.environ)
    session = probe_wayland(env)
    if session is None:
        return "no Wayland session (WAYLAND_DISPLAY) to drive"
    if session.compositor != "sway" or not env.get("SWAYSOCK"):
        return f"the Wayland compositor is {session.compositor}, not sway (no SWAYSOCK)"
    missing = [what for what in ("screenshots", "keyboard input", "pointer input") if not session.features[what]]
    if missing:
        return f"sway here offers no {', '.join(missing)}"
    absent = [p for p in SWAY_PROGRAMS if shutil.which(p) is None]
    if absent:
        return f"{' and '.join(absent)} not installed: apt-get install sway grim"
    return None
