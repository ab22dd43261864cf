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

import os
import re
from typing import Annotated, Any, Literal

from pydantic import Field

from tether.tools.desktop.desk import Desktop, UiTree
from tether.tools.desktop.keys import Button, TokenError, normalize_key
from tether.tools.desktop.ocr import OcrEngine
from tether.tools.desktop.screen import screenshot_tool
from tether.tools.desktop.x11 import desktop_problem
from tether.tools.errors import ToolError
from tether.tools.optional import MissingDependency
from tether.tools.runtime import ToolFunction, ToolSet, tool

_SCROLL = {"up": "4", "down": "5", "left": "6", "right": "7"}
_ID = re.compile(r"t(\d+)_(\d+)")


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
    from tether.tools.desktop.ui import ui_tools

    desk = Desktop(display, ocr)

    async def release() -> None:
        if ocr is None:  # an engine passed in belongs to the caller
            desk.ocr.close()

    return ToolSet("desktop", [screenshot_tool(desk.x11), *desktop_tools(desk), *ui_tools(desk)],
                   description="screen capture, OCR of on-screen text, mouse and keyboard on an X11 display",
                   on_close=release)
