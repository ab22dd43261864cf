"""Desktop tools for X11: see the screen (screenshot, OCR'd UI tree) and use mouse and keyboard.

Optional (`pip install 'tether[desktop]'` plus `apt-get install xdotool`, and an X display — a
real one or Xvfb). `desktop_toolset()` raises `MissingDependency` saying exactly what is missing,
and the device then does not list these tools.

Each tool set owns a `Desktop`: its display, its OCR engine (models load on first use), the latest
UI tree (so `click_element` clicks what `get_ui_tree` showed) and a lock that keeps one tool's
mouse and keyboard sequence from interleaving with another's. Nothing lives at module level.

`get_ui_tree` is OCR-based: the elements are the text lines on screen, not accessibility objects.
Element ids carry the tree's number (`t3_7`: tree 3, element 7), so an id from an older tree is
refused instead of clicking whatever now sits at that position in the list.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from tether.tools.desktop_keys import Button, TokenError, normalize_key
from tether.tools.errors import ToolError
from tether.tools.ocr import OcrEngine, TextElement
from tether.tools.optional import MissingDependency, require
from tether.tools.runtime import ToolFunction, ToolSet, tool
from tether.tools.screen import Capture, grab, screenshot_tool
from tether.tools.x11 import X11, Window, display_problem

DESKTOP_HINT = "the desktop tools need their extra: pip install 'tether[desktop]'"
_BUTTONS = {"left": "1", "middle": "2", "right": "3", "double": "1"}
_SCROLL = {"up": "4", "down": "5", "left": "6", "right": "7"}
_ID = re.compile(r"t(\d+)_(\d+)")


@dataclass(frozen=True, slots=True)
class UiTree:
    """One `get_ui_tree` answer, kept so `click_element` can act on it."""

    number: int
    elements: dict[str, TextElement]
    window: Window | None
    taken_at: float


class Desktop:
    """Everything one desktop tool set owns (see the module docstring)."""

    def __init__(self, display: str, ocr: OcrEngine | None = None) -> None:
        self.x11 = X11(display)
        self.ocr = ocr or OcrEngine()
        self.tree: UiTree | None = None
        self._trees = 0
        self.input_lock = asyncio.Lock()

    async def read_screen(self, region: dict[str, int] | None = None,
                          id_prefix: str = "e") -> tuple[Capture, list[TextElement], dict[str, float]]:
        """Grab and OCR the screen (or a region): the capture, its text elements, and timings in ms."""
        t0 = time.perf_counter()
        capture = await grab(self.x11, region)
        t1 = time.perf_counter()
        elements = await asyncio.to_thread(self.ocr.recognize, capture, id_prefix)
        t2 = time.perf_counter()
        return capture, elements, {"screenshot": (t1 - t0) * 1e3, "ocr": (t2 - t1) * 1e3}

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
        width, height = await self.x11.screen_size()
        if not (0 <= x < width and 0 <= y < height):
            raise ToolError(f"({x}, {y}) is outside the {width}x{height} screen")

    async def click_at(self, x: int, y: int, button: Button = "left") -> None:
        """Move the pointer there and click. Not `mousemove --sync`: it waits for the pointer to move and
        so hangs when it is already there; the X server handles the motion before the click anyway."""
        args = ["mousemove", str(x), str(y), "click"]
        # xdotool sleeps `--delay` (100 ms by default) after every click, even a single one
        args += ["--repeat", "2", "--delay", "80"] if button == "double" else ["--delay", "0"]
        async with self.input_lock:
            await self.x11.xdotool(*args, _BUTTONS[button])

    async def press(self, combos: list[str], delay_ms: int = 12) -> None:
        async with self.input_lock:
            await self.x11.xdotool("key", "--delay", str(delay_ms), *combos)

    async def type_literal(self, text: str, delay_ms: int) -> None:
        """Type `text` exactly; the xdotool timeout grows with the text so long input is not cut off."""
        await self.x11.xdotool("type", "--delay", str(delay_ms), "--", text,
                               timeout=5.0 + len(text) * (delay_ms + 5) / 1000)

    async def app_window(self, app: str) -> Window:
        """The window whose title or class contains `app`, brought forward and given the keyboard."""
        windows = await self.x11.find_windows(app)
        if not windows:
            names = sorted({w.title for w in await self._all_windows() if w.title})
            raise ToolError(f"no visible window whose title or class contains {app!r}; open windows: {names}",
                            {"open_windows": names})
        await self.x11.activate(windows[0])
        return await self.x11.window(windows[0].id)

    async def _all_windows(self) -> list[Window]:
        found = []
        for wid in sorted(await self.x11.visible_windows()):
            try:
                found.append(await self.x11.window(wid))
            except ToolError:
                continue
        return found


def _element_list(tree: UiTree, limit: int = 40) -> str:
    items = [f"{e.id} ({e.text!r})" for e in list(tree.elements.values())[:limit]]
    more = len(tree.elements) - limit
    return ", ".join(items) + (f" and {more} more" if more > 0 else "") if items else "(none: no text was found)"


def desktop_tools(desk: Desktop) -> list[ToolFunction]:
    """The observation and input tools bound to one `Desktop`."""

    @tool(tool_type="data_collection", timeout=120)
    async def get_ui_tree(activeWindow: bool = False,
                          minConfidence: Annotated[float, Field(ge=0, le=1)] = 0.5) -> dict[str, Any]:
        """List the text on screen found by OCR: each element's id, text, bounding box and confidence,
        plus the active window's title. `click_element` takes an id from the latest tree."""
        window = await desk.x11.active_window()
        region = window.region if activeWindow and window is not None else None
        number = desk.new_tree_number()
        capture, elements, timings = await desk.read_screen(region, f"t{number}_")
        elements = [e for e in elements if e.confidence >= minConfidence]
        tree = desk.remember(number, elements, window)
        width, height = await desk.x11.screen_size()
        return {"tree": tree.number, "window_title": window.title if window else None,
                "window": window.as_dict() if window else None, "elements": [e.as_dict() for e in elements],
                "count": len(elements), "captured": capture.region, "screen": {"width": width, "height": height},
                "timings_ms": {k: round(v, 1) for k, v in timings.items()}}

    @tool(tool_type="action")
    async def click_element(control_id: str, button: Button = "left") -> dict[str, Any]:
        """Click the centre of an element from the latest `get_ui_tree` (ids from older trees are refused)."""
        tree = desk.tree
        if tree is None:
            raise ToolError("no UI tree yet: call get_ui_tree first, then click one of its element ids")
        element = tree.elements.get(control_id)
        if element is None:
            m = _ID.fullmatch(control_id)
            if m and int(m.group(1)) != tree.number:
                why = (f"{control_id!r} is from UI tree {m.group(1)}, but the latest is tree {tree.number} "
                       "(the screen may have changed): use an id from the latest tree")
            else:
                why = f"no element {control_id!r} in the latest UI tree (tree {tree.number})"
            raise ToolError(f"{why}; valid ids: {_element_list(tree)}", {"valid_ids": list(tree.elements)})
        x, y = element.center
        await desk.click_at(x, y, button)
        return {"clicked": element.as_dict(), "x": x, "y": y, "button": button, "tree": tree.number}

    @tool(tool_type="action")
    async def click(x: int, y: int, button: Button = "left") -> dict[str, Any]:
        """Click at screen coordinates (pixels from the top-left corner)."""
        await desk.check_point(x, y)
        await desk.click_at(x, y, button)
        return {"x": x, "y": y, "button": button}

    @tool(tool_type="action")
    async def press_key(key: str) -> dict[str, Any]:
        """Press a key or combination: `Enter`, `Tab`, `Escape`, `ctrl+c`, `cmd+k` (Super), `F5`, `Page_Down`."""
        try:
            combo = normalize_key(key)
        except TokenError as exc:
            raise ToolError(str(exc)) from None
        await desk.press([combo])
        return {"key": key, "pressed": combo}

    @tool(tool_type="action")
    async def scroll(direction: Literal["up", "down", "left", "right"],
                     amount: Annotated[int, Field(ge=1, le=100)] = 3,
                     x: int | None = None, y: int | None = None) -> dict[str, Any]:
        """Scroll with the mouse wheel, `amount` notches, at (x, y) if given, else where the pointer is."""
        if (x is None) != (y is None):
            raise ToolError("give both x and y, or neither")
        args: list[str] = []
        if x is not None and y is not None:
            await desk.check_point(x, y)
            args += ["mousemove", str(x), str(y)]
        args += ["click", "--repeat", str(amount), "--delay", "20", _SCROLL[direction]]
        async with desk.input_lock:
            await desk.x11.xdotool(*args)
        return {"direction": direction, "amount": amount, "x": x, "y": y}

    @tool(tool_type="action", timeout=300)
    async def type_text(text: str, delayMs: Annotated[int, Field(ge=0, le=1000)] = 12) -> dict[str, Any]:
        """Type `text` literally into whatever has the keyboard focus (no special tokens; see ui.typeText)."""
        if len(text) * (delayMs + 5) > 280_000:
            raise ToolError(f"{len(text)} characters at {delayMs} ms each would take too long; split the text")
        async with desk.input_lock:
            await desk.type_literal(text, delayMs)
        return {"typed_chars": len(text)}

    return [get_ui_tree, click_element, click, press_key, scroll, type_text]


def desktop_problem(display: str | None = None) -> str | None:
    """What is missing for the desktop tools here (packages, xdotool, a display), or None."""
    for module in ("mss", "PIL", "numpy", "rapidocr_onnxruntime"):
        try:
            require(module, DESKTOP_HINT)
        except MissingDependency as exc:
            return str(exc)
    return display_problem(display if display is not None else os.environ.get("DISPLAY"))


def desktop_toolset(display: str | None = None, ocr: OcrEngine | None = None) -> ToolSet:
    """A fresh desktop tool set on `display` (default: $DISPLAY); `MissingDependency` if it cannot run.

    `ocr` lets several tool sets share one loaded engine (tests, benchmarks); by default each set
    creates its own, loaded on first use.
    """
    display = display if display is not None else os.environ.get("DISPLAY")
    problem = desktop_problem(display)
    if problem:
        raise MissingDependency(problem)
    assert display is not None
    from tether.tools.desktop_ui import ui_tools

    desk = Desktop(display, ocr)

    async def release() -> None:
        if ocr is None:  # an engine passed in belongs to the caller
            desk.ocr.close()

    return ToolSet("desktop", [screenshot_tool(desk.x11), *desktop_tools(desk), *ui_tools(desk)],
                   description="screen capture, OCR of on-screen text, mouse and keyboard on an X11 display",
                   on_close=release)
