"""A sway session (or another wlroots compositor with sway's IPC) as the desktop tools' display: windows
from `swaymsg -t get_tree`, screenshots with `grim` (wlr-screencopy), pointer and keyboard through the
virtual pointer and keyboard protocols (`wlinput`).

It answers the same questions as `x11.X11` (screen size, windows, the active one) so the tools above
need not know which they drive. Sway has no pointer query: "the window under the pointer" is the
focused one. Input goes through one Wayland connection with its own virtual pointer and keyboard, kept
for the tool set's life; on a seat with no other device (a headless compositor) a client may miss the
first event after such a device appears, which a real seat (with a keyboard and a mouse) never shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

from tether.tools.desktop.screen import Capture
from tether.tools.desktop.wayland import wayland_socket
from tether.tools.desktop.wlinput import WlInput, keysym_of
from tether.tools.desktop.x11 import Window, process_family
from tether.tools.errors import ToolError

TIMEOUT_S = 5.0
_POLL_S = 0.05
_LITERAL_KEYS = {"\n": "Return", "\t": "Tab"}


class SwayWm:
    """One sway session: the environment its clients need (WAYLAND_DISPLAY, XDG_RUNTIME_DIR, SWAYSOCK)."""

    kind = "sway"

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {**env}
        path = wayland_socket(self.env)
        if path is None:
            raise ToolError("no Wayland socket: WAYLAND_DISPLAY and XDG_RUNTIME_DIR must be set")
        self.socket = path
        self.display = self.env.get("WAYLAND_DISPLAY", "")
        self._device: WlInput | None = None

    async def _run(self, *argv: str, stdin: bytes | None = None) -> bytes:
        proc = await asyncio.create_subprocess_exec(
            *argv, env={**os.environ, **self.env}, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            async with asyncio.timeout(TIMEOUT_S):
                out, err = await proc.communicate(stdin)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            raise ToolError(f"{argv[0]} failed: {err.decode(errors='replace').strip() or proc.returncode}")
        return out

    async def msg(self, *args: str) -> Any:
        return json.loads(await self._run("swaymsg", "-r", *args))

    async def screen_size(self) -> tuple[int, int]:
        outputs = [o for o in await self.msg("-t", "get_outputs") if o.get("active")]
        if not outputs:
            raise ToolError("sway has no active output")
        return (max(o["rect"]["x"] + o["rect"]["width"] for o in outputs),
                max(o["rect"]["y"] + o["rect"]["height"] for o in outputs))

    async def _windows(self) -> list[tuple[Window, bool, bool]]:
        """Every application window: (window, focused, visible)."""
        found: list[tuple[Window, bool, bool]] = []

        def walk(node: dict[str, Any]) -> None:
            if node.get("pid") is not None and node.get("type") in ("con", "floating_con"):
                r = node["rect"]
                props = node.get("window_properties") or {}
                names = [n for n in (node.get("app_id"), props.get("class"), props.get("instance")) if n]
                found.append((Window(id=int(node["id"]), title=node.get("name") or "", x=r["x"], y=r["y"],
                                     width=r["width"], height=r["height"], pid=int(node["pid"]), wm_class=names),
                              bool(node.get("focused")), bool(node.get("visible"))))
            for child in node.get("nodes", []) + node.get("floating_nodes", []):
                walk(child)

        walk(await self.msg("-t", "get_tree"))
        return found

    async def active_window_id(self) -> int | None:
        return next((w.id for w, focused, _ in await self._windows() if focused), None)

    async def active_window(self) -> Window | None:
        return next((w for w, focused, _ in await self._windows() if focused), None)

    async def window_at_pointer(self) -> int | None:
        return await self.active_window_id()

    async def window(self, wid: int) -> Window:
        for w, _focused, _visible in await self._windows():
            if w.id == wid:
                return w
        raise ToolError(f"no window {wid} in sway's tree")

    async def visible_windows(self) -> set[int]:
        return {w.id for w, _focused, visible in await self._windows() if visible}

    async def find_windows(self, text: str) -> list[Window]:
        needle = text.casefold()
        return [w for w, _f, visible in await self._windows()
                if visible and (needle in w.title.casefold() or any(needle in n.casefold() for n in w.wm_class))]

    async def wait_for_window(self, *, pid: int | None = None, name: str | None = None, timeout: float,
                              known: set[int] | None = None,
                              alive: Callable[[], bool] | None = None) -> tuple[Window | None, str]:
        """As `X11.wait_for_window`: the first visible window of `pid` or its descendants (sway knows each
        window's client pid, Wayland and Xwayland alike), or titled/classed like `name`, or one not in
        `known` whose pid belongs to `pid`'s process tree. Reads the tree every 50 ms for up to `timeout`
        seconds, stopping early once `alive()` is false; returns the window (or None) and how it was
        found ("pid", "name", "new window", "exited", "none")."""
        deadline = time.monotonic() + timeout
        while True:
            family = process_family(pid) if pid is not None else set()
            shown = [w for w, _focused, visible in await self._windows() if visible and w.width > 1]
            for win in shown:
                if win.pid in family:
                    return win, "pid"
            if name is not None:
                needle = name.casefold()
                for win in shown:
                    if needle in win.title.casefold() or any(needle in n.casefold() for n in win.wm_class):
                        return win, "name"
            if known is not None:
                for win in shown:
                    if win.id not in known and (pid is None or win.pid is None or win.pid in family):
                        return win, "new window"
            if alive is not None and not alive():
                return None, "exited"
            if time.monotonic() >= deadline:
                return None, "none"
            await asyncio.sleep(_POLL_S)

    async def activate(self, win: Window) -> None:
        await self.msg(f"[con_id={win.id}]", "focus")

    def grab_sync(self, region: dict[str, int] | None) -> Capture:
        """One screenshot with grim (PPM on stdout) as BGRA; call it in a worker thread."""
        import numpy as np

        argv = ["grim", "-t", "ppm"]
        if region is not None:
            argv += ["-g", f"{region['x']},{region['y']} {region['width']}x{region['height']}"]
        proc = subprocess.run([*argv, "-"], env={**os.environ, **self.env}, capture_output=True, timeout=TIMEOUT_S,
                              check=False)
        if proc.returncode != 0:
            raise ToolError(f"grim failed: {proc.stderr.decode(errors='replace').strip()}")
        head = proc.stdout.split(b"\n", 3)  # P6, "W H", 255, pixels
        width, height = (int(v) for v in head[1].split())
        rgb = np.frombuffer(head[3], np.uint8, width * height * 3).reshape(height, width, 3)
        bgra = np.empty((height, width, 4), np.uint8)
        bgra[:, :, 0], bgra[:, :, 1], bgra[:, :, 2], bgra[:, :, 3] = rgb[:, :, 2], rgb[:, :, 1], rgb[:, :, 0], 255
        x, y = (region["x"], region["y"]) if region else (0, 0)
        return Capture(x, y, width, height, bgra.tobytes())

    async def _input(self, use: Any) -> None:
        """Run `use(device)` on this session's virtual devices (opened on first use, kept: a new device per
        call would make clients switch keymaps before every key). Callers hold the desktop's input lock."""
        def run() -> None:
            if self._device is None:
                self._device = WlInput(self.socket).open()
            try:
                use(self._device)
            except OSError:
                self.close()
                raise

        try:
            await asyncio.to_thread(run)
        except OSError as exc:
            raise ToolError(f"input to sway failed: {exc}") from None

    def close(self) -> None:
        """Drop the virtual devices (the next input opens new ones)."""
        if self._device is not None:
            self._device.close()
            self._device = None

    async def click(self, x: int, y: int, button: str) -> None:
        width, height = await self.screen_size()
        count = 2 if button == "double" else 1
        real = "left" if button == "double" else button
        await self._input(lambda d: d.click(x, y, width, height, real, count))

    async def scroll(self, direction: str, amount: int, x: int | None, y: int | None) -> None:
        width, height = await self.screen_size()
        await self._input(lambda d: d.scroll(x, y, width, height, direction, amount))

    async def press(self, combos: list[str], delay_ms: int) -> None:
        """xdotool-style combinations (`ctrl+shift+t`, `Return`)."""
        strokes: list[tuple[list[str], str]] = []
        for combo in combos:
            *mods, key = combo.split("+") if combo != "plus" else ["plus"]
            strokes.append(([m for m in mods if m], key))
        await self._input(lambda d: d.keys(strokes, delay_ms))

    async def type_text(self, text: str, delay_ms: int) -> None:
        strokes: list[tuple[list[str], str]] = [([], _LITERAL_KEYS.get(ch) or keysym_of(ch)) for ch in text]
        await self._input(lambda d: d.keys(strokes, delay_ms))
