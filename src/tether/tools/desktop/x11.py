"""The X11 display as the desktop tools see it: is there one, what is active, and `xdotool` to drive it.

Everything goes through the `xdotool` (and, when present, `xprop`) programs, run from argv lists
with a timeout and an explicit environment (`DISPLAY`, `XAUTHORITY`), so the tools need no X
library bindings and a hung X server costs one timeout, never a stuck device.

Without a window manager (a bare Xvfb) there is no `_NET_ACTIVE_WINDOW`: the "active window" is
then the window holding the keyboard focus, and failing that the one under the pointer. Programs
that do not set `_NET_WM_PID` (Tk, some X toolkits) have no pid to find them by: waiting for the
window of a new process then falls back to "a visible window that was not there before".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tether.tools.errors import MissingDependency, ToolError, require
from tether.tools.running.process import safe_environment

XDOTOOL_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 3.0
NO_DISPLAY_HINT = "no X display: set DISPLAY or run under Xvfb (e.g. `Xvfb :99 -screen 0 1280x800x24 -noreset &`)"
XDOTOOL_HINT = "xdotool is not installed: apt-get install xdotool"
DESKTOP_HINT = "the desktop tools need their extra: pip install 'tether[desktop]'"
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Window:
    """A top-level window: what a planner needs to recognise it, and where it is on screen."""

    id: int
    title: str
    x: int
    y: int
    width: int
    height: int
    pid: int | None = None
    wm_class: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def region(self) -> dict[str, int]:
        return {"x": self.x, "y": self.y, "width": self.width, "height": self.height}


def display_env(display: str) -> dict[str, str]:
    """The environment for X clients: the safe base plus the display and its auth cookie file."""
    extra = {"DISPLAY": display}
    if os.environ.get("XAUTHORITY"):
        extra["XAUTHORITY"] = os.environ["XAUTHORITY"]
    return safe_environment(extra)


def display_socket(display: str | None) -> str | None:
    """The unix socket of a local X display (`:0`, `:1.0`, `unix:2` -> /tmp/.X11-unix/X<n>, its real path)
    when it exists, else None (no display, a TCP one such as `host:0`, or no socket there)."""
    match = re.fullmatch(r"(?:unix)?:(\d+)(?:\.\d+)?", display or "")
    if match is None:
        return None
    path = os.path.realpath(f"/tmp/.X11-unix/X{match.group(1)}")
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


def desktop_problem(display: str | None = None, *, probe: bool = True) -> str | None:
    """What is missing for the desktop tools here (packages, xdotool, a display), or None.

    `display` defaults to $DISPLAY. With `probe=False` the display is not asked (no subprocess): only
    what can be known without it, so a device without a display or the extra skips importing the
    desktop tools; `desktop_toolset` then checks again with the probe.
    """
    missing = module_problem()
    if missing:
        return missing
    display = display if display is not None else os.environ.get("DISPLAY")
    if not display and not probe and os.environ.get("WAYLAND_DISPLAY"):
        return None  # a Wayland session: desktop_toolset asks the compositor (sway is driven too)
    return display_problem(display, probe=probe)


def module_problem() -> str | None:
    """Which Python package the desktop tools need is missing, or None."""
    for module in ("mss", "PIL", "numpy", "rapidocr_onnxruntime"):
        try:
            require(module, DESKTOP_HINT)
        except MissingDependency as exc:
            return str(exc)
    return None


def display_problem(display: str | None, *, probe: bool = True) -> str | None:
    """Why the desktop tools cannot run on `display`, or None when it answers (with `probe=False`:
    None when a display is named and xdotool is installed, without asking the display).

    Synchronous and bounded (a few seconds at most): it runs once, when the tool set is created.
    A refused connection is tried again twice, 100 ms apart: an X server refuses connections while it
    resets after its last client left (Xvfb without -noreset does that between programs).
    """
    if not display:
        if probe and os.environ.get("WAYLAND_DISPLAY"):
            from tether.tools.desktop.wayland import probe_wayland, sway_problem, wayland_refusal

            session = probe_wayland()
            if session is not None:
                return wayland_refusal(session, sway_problem())
        return NO_DISPLAY_HINT
    if shutil.which("xdotool") is None:
        return XDOTOOL_HINT
    if not probe:
        return None
    for attempt in range(3):
        try:
            proc = subprocess.run(["xdotool", "getdisplaygeometry"], env=display_env(display), capture_output=True,
                                  timeout=PROBE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return f"X display {display!r} did not answer within {PROBE_TIMEOUT_S:g}s; {NO_DISPLAY_HINT}"
        if proc.returncode == 0:
            return None
        if attempt < 2:
            time.sleep(0.1)  # retry backoff: an X server that is (re)starting refuses for a moment
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    return f"cannot open X display {display!r} ({err[0] if err else 'xdotool failed'}); {NO_DISPLAY_HINT}"


def _parse_shell(text: str) -> dict[str, str]:
    """`KEY=value` lines (xdotool's `--shell` output)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


class X11:
    """One X display, driven through xdotool. Holds no connection: every call is its own process."""

    def __init__(self, display: str) -> None:
        self.display = display
        self.env = display_env(display)
        self.has_xprop = shutil.which("xprop") is not None

    async def _exec(self, argv: list[str], timeout: float) -> tuple[int, str, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
        except FileNotFoundError:
            raise ToolError(XDOTOOL_HINT if argv[0] == "xdotool" else f"{argv[0]} is not installed") from None
        try:
            async with asyncio.timeout(timeout):
                out, err = await proc.communicate()
        except BaseException:  # timeout or cancellation: never leave the child behind
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")

    async def xdotool(self, *args: str, timeout: float = XDOTOOL_TIMEOUT_S, check: bool = True) -> str:
        """Run `xdotool ARGS` and return its stdout; a failure or a warning it ignored is a ToolError.

        xdotool exits 0 after "No such key name", so that warning is turned into an error here:
        otherwise a misspelt key would be reported as pressed.
        """
        try:
            code, out, err = await self._exec(["xdotool", *args], timeout)
        except TimeoutError:
            raise ToolError(f"xdotool {args[0] if args else ''} did not finish within {timeout:g}s "
                            f"(is the X display {self.display!r} responsive?)") from None
        if "No such key name" in err:
            bad = err.strip().splitlines()[0]
            raise ToolError(f"unknown key: {bad.removeprefix('(symbol) ')} (use X keysym names such as "
                            "Return, Tab, Escape, BackSpace, Up, F5, ctrl+c)")
        if check and code != 0:
            detail = err.strip().splitlines()[-1] if err.strip() else f"exit code {code}"
            raise ToolError(f"xdotool {' '.join(args[:2])} failed: {detail}")
        return out

    async def screen_size(self) -> tuple[int, int]:
        w, h = (await self.xdotool("getdisplaygeometry")).split()
        return int(w), int(h)

    async def window(self, wid: int) -> Window:
        """Title, geometry and (when the program tells) pid and WM_CLASS of one window."""
        out = await self.xdotool("getwindowname", str(wid), "getwindowgeometry", "--shell", str(wid))
        name, sep, shell = out.rpartition("WINDOW=")  # the name comes first and may itself hold '='
        title = name.removesuffix("\n") if sep else ""
        geo = _parse_shell(sep + shell)
        pid, wm_class = await self._props(wid)
        return Window(id=wid, title=title, x=int(geo.get("X", 0)), y=int(geo.get("Y", 0)),
                      width=int(geo.get("WIDTH", 0)), height=int(geo.get("HEIGHT", 0)), pid=pid, wm_class=wm_class)

    async def _props(self, wid: int) -> tuple[int | None, list[str]]:
        if not self.has_xprop:
            out = await self.xdotool("getwindowpid", str(wid), check=False)
            return (int(out) if out.strip().isdigit() else None), []
        try:
            _code, out, _ = await self._exec(["xprop", "-id", str(wid), "-notype", "_NET_WM_PID", "WM_CLASS"],
                                            XDOTOOL_TIMEOUT_S)
        except TimeoutError:
            return None, []
        pid, wm_class = None, []
        for line in out.splitlines():
            name, _, value = line.partition("=")
            if name.strip() == "_NET_WM_PID" and value.strip().isdigit():
                pid = int(value)
            elif name.strip() == "WM_CLASS":
                wm_class = [part.strip().strip('"') for part in value.split(",") if part.strip()]
        return pid, wm_class

    async def active_window_id(self) -> int | None:
        """The EWMH active window; without a window manager, the focused client; then the one under the pointer."""
        out = await self.xdotool("getactivewindow", check=False)
        if out.strip().isdigit():
            return int(out)
        out = await self.xdotool("getwindowfocus", check=False)
        if out.strip().isdigit() and int(out) > 1:  # 1 is PointerRoot: nobody holds the focus
            return int(out)
        return await self.window_at_pointer()

    async def window_at_pointer(self) -> int | None:
        """The top-most named visible window under the pointer (xdotool lists them bottom to top)."""
        loc = _parse_shell(await self.xdotool("getmouselocation", "--shell", check=False))
        if "X" not in loc:
            return None
        px, py = int(loc["X"]), int(loc["Y"])
        out = await self.xdotool("search", "--onlyvisible", "--name", ".", check=False)
        for wid in reversed([int(x) for x in out.split() if x.isdigit()]):
            geo = _parse_shell(await self.xdotool("getwindowgeometry", "--shell", str(wid), check=False))
            if not geo.get("WIDTH"):
                continue
            x, y, w, h = (int(geo[k]) for k in ("X", "Y", "WIDTH", "HEIGHT"))
            if w > 1 and h > 1 and x <= px < x + w and y <= py < y + h:
                return wid
        return None

    async def active_window(self) -> Window | None:
        wid = await self.active_window_id()
        if wid is None:
            return None
        try:
            return await self.window(wid)
        except ToolError:  # it closed between the two calls
            return None

    async def visible_windows(self) -> set[int]:
        """Ids of the mapped windows that have a name (how xdotool sees top-level clients)."""
        out = await self.xdotool("search", "--onlyvisible", "--name", ".", check=False)
        return {int(x) for x in out.split() if x.isdigit()}

    async def find_windows(self, text: str) -> list[Window]:
        """Visible windows whose title or class contains `text` (case-insensitive)."""
        ids: list[int] = []
        for kind in ("--name", "--class", "--classname"):
            out = await self.xdotool("search", "--onlyvisible", kind, _literal_regex(text), check=False)
            ids += [int(x) for x in out.split() if x.isdigit() and int(x) not in ids]
        found = []
        for wid in ids:
            with contextlib.suppress(ToolError):
                win = await self.window(wid)
                if win.width > 1 and win.height > 1:
                    found.append(win)
        return found

    async def activate(self, win: Window) -> None:
        """Bring a window forward and give it the keyboard: EWMH activation when a window manager
        supports it, else raise + XSetInputFocus (what works on a bare X server)."""
        with contextlib.suppress(ToolError):
            await self.xdotool("windowactivate", "--sync", str(win.id), check=False, timeout=2.0)
        if await self.active_window_id() != win.id:
            await self.xdotool("windowraise", str(win.id), "windowfocus", "--sync", str(win.id), check=False)

    async def wait_for_window(self, *, pid: int | None = None, name: str | None = None, timeout: float,
                              known: set[int] | None = None,
                              alive: Callable[[], bool] | None = None) -> tuple[Window | None, str]:
        """The first visible window of `pid` or its descendants (by `_NET_WM_PID`), or titled/classed like
        `name`, or — when `known` (the windows before a launch) is given — one that was not there before
        and whose pid, if it has one, belongs to `pid`'s process tree.

        Polls every 50 ms for up to `timeout` seconds, and stops early once `alive()` is false.
        Returns the window (or None) and how it was found ("pid", "name", "new window", "exited", "none").
        """
        deadline = time.monotonic() + timeout
        while True:
            family = process_family(pid) if pid is not None else set()
            for member in sorted(family):
                out = await self.xdotool("search", "--onlyvisible", "--pid", str(member), check=False)
                for wid in (int(x) for x in out.split() if x.isdigit()):
                    with contextlib.suppress(ToolError):
                        win = await self.window(wid)
                        if win.width > 1:
                            return win, "pid"
            if name is not None:
                wins = await self.find_windows(name)
                if wins:
                    return wins[0], "name"
            if known is not None:
                for wid in sorted((await self.visible_windows()) - known):
                    with contextlib.suppress(ToolError):
                        win = await self.window(wid)
                        if win.width > 1 and (pid is None or win.pid is None or win.pid in family):
                            return win, "new window"
            if alive is not None and not alive():
                return None, "exited"
            if time.monotonic() >= deadline:
                return None, "none"
            await asyncio.sleep(_POLL_S)


def process_family(pid: int) -> set[int]:
    """`pid` and its descendants (just `pid` when it is gone): a launcher script's window belongs to the
    child it started."""
    import psutil

    try:
        return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}


def _literal_regex(text: str) -> str:
    """xdotool search takes a POSIX extended regex (case-insensitive): match `text` literally."""
    return "".join(f"\\{ch}" if ch in ".[]{}()*+?^$|\\" else ch for ch in text)
