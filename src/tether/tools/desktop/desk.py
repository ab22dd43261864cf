"""`Desktop`: everything one desktop tool set owns — its display, its OCR engine, the latest UI tree and
the lock that keeps one tool's mouse and keyboard sequence from interleaving with another's.

Both the plain desktop tools (`tool`) and the `ui.*` skills (`ui`) are built on one `Desktop`; it lives
here, below both, so neither imports the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from tether.tools.desktop.a11y.bus import A11yBus
from tether.tools.desktop.frames import FrameStore, crop, describe, difference
from tether.tools.desktop.keys import Button
from tether.tools.desktop.ocr import OcrEngine, TextElement
from tether.tools.desktop.screen import Capture, grab
from tether.tools.desktop.sway import SwayWm
from tether.tools.desktop.x11 import X11, Window
from tether.tools.errors import ToolError

_BUTTONS = {"left": "1", "middle": "2", "right": "3", "double": "1"}
_SCROLL = {"up": "4", "down": "5", "left": "6", "right": "7"}


@dataclass(frozen=True, slots=True)
class UiTree:
    """One `get_ui_tree` answer, kept so `click_element` can act on it."""

    number: int
    elements: dict[str, TextElement]
    window: Window | None
    taken_at: float


class Desktop:
    """Everything one desktop tool set owns (see the module docstring of `tether.tools.desktop.tool`)."""

    def __init__(self, display: str, ocr: OcrEngine | None = None, session_bus: str | None = None,
                 wm: SwayWm | None = None) -> None:
        self.wm: X11 | SwayWm = wm if wm is not None else X11(display)
        self.ocr = ocr or OcrEngine()
        self.a11y = A11yBus(session_bus, display if wm is None else None, self.wm.env)
        self.frames = FrameStore()
        self.tree: UiTree | None = None
        self._trees = 0
        self.input_lock = asyncio.Lock()

    async def read_screen(self, region: dict[str, int] | None = None,
                          id_prefix: str = "e") -> tuple[Capture, list[TextElement], dict[str, float]]:
        """Grab and OCR the screen (or a region): the capture, its text elements, and timings in ms."""
        t0 = time.perf_counter()
        capture = await grab(self.wm, region)
        t1 = time.perf_counter()
        elements = await asyncio.to_thread(self.ocr.recognize, capture, id_prefix)
        t2 = time.perf_counter()
        return capture, elements, {"screenshot": (t1 - t0) * 1e3, "ocr": (t2 - t1) * 1e3}

    async def check_frame(self, frame_id: str | None, point: tuple[int, int] | None = None) -> dict[str, Any]:
        """Before an action: compare the screen with frame `frame_id` (the screenshot the action is based
        on). Returns how it was checked; a ToolError describing the change when the screen changed, or
        when the frame is unknown. Without a frame id nothing is checked, and the answer says so."""
        if frame_id is None:
            return {"checked": False, "note": "no frame named: the action was not checked against a screenshot "
                                              "(pass `frame` to have it refused when the screen has changed)"}
        frame = self.frames.get(frame_id)
        if frame is None:
            raise ToolError(f"unknown frame {frame_id!r} (this desktop keeps {self.frames.ids() or 'none'}); take a "
                            "new screenshot and act on its frame", {"stale": True, "frame": frame_id})
        now = await grab(self.wm, frame.capture.region)
        change = await asyncio.to_thread(difference, frame.capture, now)
        if change is None:
            return {"checked": True, "frame": frame_id, "unchanged": True}
        before = after = None
        try:
            before, after = [" ".join(e.text for e in await asyncio.to_thread(self.ocr.recognize, crop(c, change.box)))
                             for c in (frame.capture, now)]
        except ToolError:  # no OCR engine here: the box and counts still say what changed
            pass
        message, details = describe(change, frame, point, before, after)
        raise ToolError(message, details)

    def new_tree_number(self) -> int:
        """Numbered when the tree is started, so its ids are known before the OCR pass ends."""
        self._trees += 1
        return self._trees

    def remember(self, number: int, elements: list[TextElement], window: Window | None) -> UiTree:
        """Keep tree `number` for click_element, unless a later-started tree was kept already."""
        tree = UiTree(number, {e.id: e for e in elements}, window, time.time())
        if self.tree is None or self.tree.number < number:
            self.tree = tree
        return tree

    async def check_point(self, x: int, y: int) -> None:
        width, height = await self.wm.screen_size()
        if not (0 <= x < width and 0 <= y < height):
            raise ToolError(f"({x}, {y}) is outside the {width}x{height} screen")

    async def click_at(self, x: int, y: int, button: Button = "left") -> None:
        """Move the pointer there and click. Not `mousemove --sync`: it waits for the pointer to move and
        so hangs when it is already there; the X server handles the motion before the click anyway."""
        if isinstance(self.wm, SwayWm):
            async with self.input_lock:
                await self.wm.click(x, y, button)
            return
        args = ["mousemove", str(x), str(y), "click"]
        # xdotool sleeps `--delay` (100 ms by default) after every click, even a single one
        args += ["--repeat", "2", "--delay", "80"] if button == "double" else ["--delay", "0"]
        async with self.input_lock:
            await self.wm.xdotool(*args, _BUTTONS[button])

    async def press(self, combos: list[str], delay_ms: int = 12, *, locked: bool = False) -> None:
        """Press xdotool-style key combinations (`ctrl+c`, `Return`); `locked`: the caller holds input_lock."""
        async with contextlib.nullcontext() if locked else self.input_lock:
            if isinstance(self.wm, SwayWm):
                await self.wm.press(combos, delay_ms)
            else:
                await self.wm.xdotool("key", "--delay", str(delay_ms), *combos)

    async def type_literal(self, text: str, delay_ms: int) -> None:
        """Type `text` exactly (the caller holds input_lock); the xdotool timeout grows with the text so
        long input is not cut off."""
        if isinstance(self.wm, SwayWm):
            await self.wm.type_text(text, delay_ms)
            return
        await self.wm.xdotool("type", "--delay", str(delay_ms), "--", text,
                              timeout=5.0 + len(text) * (delay_ms + 5) / 1000)

    async def scroll(self, direction: str, amount: int, x: int | None, y: int | None) -> None:
        """`amount` wheel notches, at (x, y) when given."""
        async with self.input_lock:
            if isinstance(self.wm, SwayWm):
                await self.wm.scroll(direction, amount, x, y)
                return
            args: list[str] = ["mousemove", str(x), str(y)] if x is not None and y is not None else []
            await self.wm.xdotool(*args, "click", "--repeat", str(amount), "--delay", "20", _SCROLL[direction])

    async def app_window(self, app: str) -> Window:
        """The window whose title or class contains `app`, brought forward and given the keyboard."""
        windows = await self.wm.find_windows(app)
        if not windows:
            names = sorted({w.title for w in await self._all_windows() if w.title})
            raise ToolError(f"no visible window whose title or class contains {app!r}; open windows: {names}",
                            {"open_windows": names})
        await self.wm.activate(windows[0])
        return await self.wm.window(windows[0].id)

    async def _all_windows(self) -> list[Window]:
        found = []
        for wid in sorted(await self.wm.visible_windows()):
            try:
                found.append(await self.wm.window(wid))
            except ToolError:
                continue
        return found
