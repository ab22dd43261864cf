"""Desktop tools for X11 and sway: see the screen (screenshot, the UI tree) and use mouse and keyboard.

Optional (`pip install 'tether[desktop]'` plus `apt-get install xdotool`, and an X display — a
real one or Xvfb; or a sway session and `grim`). `desktop_toolset()` raises `MissingDependency`
saying exactly what is missing, and the device then does not list these tools.

Each tool set owns a `Desktop`: its display, its OCR engine (models load on first use), the
accessibility bus, the latest OCR tree, the recent frames and a lock that keeps one tool's mouse and
keyboard sequence from interleaving with another's. Nothing lives at module level.

`get_ui_tree` reads the accessibility tree (AT-SPI) of the active window or a named application when
one is there: elements with a role, name, states, bounds, actions and an id (`a1.12-7`) that stays
the same for as long as the element lives. An application that exposes no tree is read by OCR: the
elements are then text lines, with ids that carry the tree's number (`t3_7`), so an OCR id from an
older tree is refused instead of clicking whatever now sits at that position in the list.
`click_element` and `type_text` act on an accessible element through AT-SPI (its action, its
editable text) and fall back to coordinates, OCR and the keyboard only where there is no tree; every
answer's `via` says which was used. Screenshots and trees carry a `frame` id; an action given `frame`
is refused when the screen has changed since (see `frames`).
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import Field

from tether.tools.desktop.a11y.act import do_action, grab_focus, write_text
from tether.tools.desktop.a11y.bus import A11yError, is_a11y_id
from tether.tools.desktop.a11y.tree import Element
from tether.tools.desktop.a11y.view import accessible_tree, resolve
from tether.tools.desktop.desk import Desktop, UiTree
from tether.tools.desktop.keys import Button, TokenError, normalize_key
from tether.tools.desktop.ocr import OcrEngine, TextElement, rank
from tether.tools.desktop.screen import screenshot_tool
from tether.tools.desktop.x11 import Window, desktop_problem, module_problem
from tether.tools.errors import MissingDependency, ToolError
from tether.tools.runtime import ToolFunction, ToolSet, tool

_ID = re.compile(r"t(\d+)_(\d+)")
Source = Literal["auto", "accessibility", "ocr"]
NAME_CONFIDENCE = 0.8


def _element_list(tree: UiTree, limit: int = 40) -> str:
    items = [f"{e.id} ({e.text!r})" for e in list(tree.elements.values())[:limit]]
    more = len(tree.elements) - limit
    return ", ".join(items) + (f" and {more} more" if more > 0 else "") if items else "(none: no text was found)"


def _ocr_element(desk: Desktop, control_id: str) -> TextElement:
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
    return element


async def _ocr_by_name(desk: Desktop, name: str, app: str | None) -> TextElement:
    """No accessibility tree: the on-screen text best matching `name` (score >= NAME_CONFIDENCE)."""
    region = (await desk.app_window(app)).region if app else None
    _capture, elements, _ = await desk.read_screen(region)
    ranked = rank(name, elements)
    if not ranked or ranked[0].score < NAME_CONFIDENCE:
        seen = ", ".join(repr(m.element.text) for m in ranked[:5]) or "no text at all"
        raise ToolError(f"no accessibility tree here, and no text on screen matches {name!r} (closest: {seen})")
    best = ranked[0]
    return TextElement(best.element.id, best.element.text, best.box, best.element.confidence)


def _targets(control_id: str | None, role: str | None, name: str | None) -> bool:
    if control_id is not None and (role or name):
        raise ToolError("give either control_id or role/name, not both")
    return control_id is not None or bool(role or name)


def desktop_tools(desk: Desktop) -> list[ToolFunction]:
    """The observation and input tools bound to one `Desktop`."""

    @tool(tool_type="data_collection", timeout=120)
    async def get_ui_tree(activeWindow: bool = False,
                          minConfidence: Annotated[float, Field(ge=0, le=1)] = 0.5,
                          app: str | None = None, source: Source = "auto",
                          maxElements: Annotated[int, Field(ge=1, le=5000)] = 400,
                          includeHidden: bool = False) -> dict[str, Any]:
        """The UI of the active window, or of the application or window named `app` (title or app name,
        contained): by default its accessibility tree (each element's id, role, name, states, bounds,
        actions, parent; `maxElements` bounds it, hidden subtrees only with `includeHidden`), and when it
        exposes none, the text on screen found by OCR (`activeWindow`: only that window; `minConfidence`).
        `source` forces one or the other; the answer's `source` says which, and `frame` names the
        screenshot taken with it. `click_element` and `type_text` take the ids."""
        why = None
        if source != "ocr":
            try:
                answer, why = await accessible_tree(desk, app, maxElements, includeHidden)
            except A11yError as exc:
                answer, why = {}, str(exc)
            if answer:
                return answer
            if source == "accessibility":
                raise ToolError(f"no accessibility tree: {why}")
        window: Window | None
        if app:
            window = await desk.app_window(app)
            region: dict[str, int] | None = window.region
        else:
            window = await desk.wm.active_window()
            region = window.region if activeWindow and window is not None else None
        number = desk.new_tree_number()
        capture, elements, timings = await desk.read_screen(region, f"t{number}_")
        elements = [e for e in elements if e.confidence >= minConfidence]
        tree = desk.remember(number, elements, window)
        width, height = await desk.wm.screen_size()
        out = {"source": "ocr", "tree": tree.number, "frame": desk.frames.add(capture),
               "window_title": window.title if window else None,
               "window": window.as_dict() if window else None, "elements": [e.as_dict() for e in elements],
               "count": len(elements), "captured": capture.region, "screen": {"width": width, "height": height},
               "timings_ms": {k: round(v, 1) for k, v in timings.items()}}
        if why:
            out["why_not_accessibility"] = why
        return out

    @tool(tool_type="action")
    async def click_element(control_id: str | None = None, role: str | None = None, name: str | None = None,
                            app: str | None = None, button: Button = "left", action: str | None = None,
                            frame: str | None = None) -> dict[str, Any]:
        """Click an element: by `control_id` from `get_ui_tree`, or by `role` and/or `name` in the active
        window (or `app`). An accessible element is pressed through its AT-SPI action (`action` names one;
        default click/press/activate), or clicked at its centre when it has none or for another button;
        an OCR element is clicked at its centre. `via` says which. With `frame`, refused if the screen
        changed since that screenshot."""
        if not _targets(control_id, role, name):
            raise ToolError("name the element: control_id, or role and/or name")
        if control_id is not None and not is_a11y_id(control_id):
            element = _ocr_element(desk, control_id)
            x, y = element.center
            checked = await desk.check_frame(frame, (x, y))
            await desk.click_at(x, y, button)
            return {"via": "ocr", "clicked": element.as_dict(), "x": x, "y": y, "button": button,
                    "tree": desk.tree.number if desk.tree else None, "frame_check": checked}
        why = await _no_bus(desk) if control_id is None else None
        el = None
        if why is None:
            async with desk.a11y.session() as s:
                el = await resolve(desk, s, control_id, role, name, app)
                if el is not None:
                    checked = await desk.check_frame(frame, el.center)
                    if button == "left" and el.actions:
                        done = await do_action(s, el, action)
                        return {"via": "accessibility", "action": done, "element": el.as_dict(),
                                "frame_check": checked}
            why = why or "no accessible application matches"
        if el is None:
            if not name:
                raise ToolError(f"no accessibility tree for {app or 'the active window'} ({why}): name the "
                                "element's text (`name`) to find it by OCR, or use get_ui_tree")
            found = await _ocr_by_name(desk, name, app)
            x, y = found.center
            checked = await desk.check_frame(frame, (x, y))
            await desk.click_at(x, y, button)
            return {"via": "ocr", "why": why, "clicked": found.as_dict(), "x": x, "y": y, "button": button,
                    "frame_check": checked}
        return await _click_bounds(desk, el, button, action, checked)

    @tool(tool_type="action")
    async def click(x: int, y: int, button: Button = "left", frame: str | None = None) -> dict[str, Any]:
        """Click at screen coordinates (pixels from the top-left corner); with `frame`, refused if the
        screen changed since that screenshot."""
        await desk.check_point(x, y)
        checked = await desk.check_frame(frame, (x, y))
        await desk.click_at(x, y, button)
        return {"x": x, "y": y, "button": button, "frame_check": checked}

    @tool(tool_type="action")
    async def press_key(key: str, frame: str | None = None) -> dict[str, Any]:
        """Press a key or combination: `Enter`, `Tab`, `Escape`, `ctrl+c`, `cmd+k` (Super), `F5`, `Page_Down`."""
        try:
            combo = normalize_key(key)
        except TokenError as exc:
            raise ToolError(str(exc)) from None
        checked = await desk.check_frame(frame)
        await desk.press([combo])
        return {"key": key, "pressed": combo, "frame_check": checked}

    @tool(tool_type="action")
    async def scroll(direction: Literal["up", "down", "left", "right"],
                     amount: Annotated[int, Field(ge=1, le=100)] = 3,
                     x: int | None = None, y: int | None = None, frame: str | None = None) -> dict[str, Any]:
        """Scroll with the mouse wheel, `amount` notches, at (x, y) if given, else where the pointer is."""
        if (x is None) != (y is None):
            raise ToolError("give both x and y, or neither")
        if x is not None and y is not None:
            await desk.check_point(x, y)
        checked = await desk.check_frame(frame, (x, y) if x is not None and y is not None else None)
        await desk.scroll(direction, amount, x, y)
        return {"direction": direction, "amount": amount, "x": x, "y": y, "frame_check": checked}

    @tool(tool_type="action", timeout=300)
    async def type_text(text: str, delayMs: Annotated[int, Field(ge=0, le=1000)] = 12,
                        control_id: str | None = None, role: str | None = None, name: str | None = None,
                        app: str | None = None, replace: bool = False,
                        frame: str | None = None) -> dict[str, Any]:
        """Type `text` literally (no special tokens; see ui.typeText). With an element (`control_id`, or
        `role`/`name`), editable accessible text gets it through AT-SPI at its end (`replace`: instead of
        its content) and the answer carries the text read back; another element is focused (AT-SPI, or
        clicked when from OCR) and typed into with the keyboard. Without one, the keyboard types into
        whatever has the focus. `via` says which; `frame` as for click."""
        if len(text) * (delayMs + 5) > 280_000:
            raise ToolError(f"{len(text)} characters at {delayMs} ms each would take too long; split the text")
        via = "keyboard"
        if _targets(control_id, role, name):
            if control_id is not None and not is_a11y_id(control_id):
                element = _ocr_element(desk, control_id)
                checked = await desk.check_frame(frame, element.center)
                await desk.click_at(*element.center)
                via = "keyboard, after clicking the OCR element"
            else:
                why = await _no_bus(desk) if control_id is None else None
                if why is not None:
                    raise ToolError(f"no accessibility tree ({why}): call get_ui_tree (OCR) and pass the "
                                    "field's id, or click it and type without an element")
                async with desk.a11y.session() as s:
                    el = await resolve(desk, s, control_id, role, name, app)
                    if el is None:
                        raise ToolError(f"no accessibility tree for {app or 'the active window'}: call get_ui_tree "
                                        "(OCR) and pass the field's id, or click it and type without an element")
                    checked = await desk.check_frame(frame, el.center)
                    if "editable" in el.states and el.has("org.a11y.atspi.EditableText"):
                        now = await write_text(s, el, text, replace)
                        return {"via": "accessibility", "typed_chars": len(text), "element": el.as_dict(),
                                "text_now": now, "frame_check": checked}
                    if not await grab_focus(s, el):
                        raise ToolError(f"{el.id} ({el.role} {el.name!r}) is not editable and would not take the "
                                        "keyboard focus")
                    via = "keyboard, after focusing the element through accessibility"
        else:
            checked = await desk.check_frame(frame)
        async with desk.input_lock:
            if replace:
                await desk.press(["ctrl+a"], locked=True)
            await desk.type_literal(text, delayMs)
        return {"via": via, "typed_chars": len(text), "frame_check": checked}

    return [get_ui_tree, click_element, click, press_key, scroll, type_text]


async def _no_bus(desk: Desktop) -> str | None:
    """Why there is no accessibility bus to ask, or None when there is one."""
    try:
        await desk.a11y.address()
    except A11yError as exc:
        return str(exc)
    return None


async def _click_bounds(desk: Desktop, el: Element, button: Button, action: str | None,
                        checked: dict[str, Any]) -> dict[str, Any]:
    """An accessible element without an action (or another button than left): click its centre."""
    if action is not None:
        raise ToolError(f"`action` needs the left button; {el.id} would be clicked with {button!r} at its centre")
    if el.center is None or not el.bounds or el.bounds["width"] <= 0:
        raise ToolError(f"{el.id} ({el.role} {el.name!r}) has no action and no position on screen to click")
    x, y = el.center
    await desk.check_point(x, y)
    await desk.click_at(x, y, button)
    why = "it has no accessible action" if not el.actions else f"the {button} button is a pointer click"
    return {"via": "coordinates", "why": why, "element": el.as_dict(), "x": x, "y": y, "button": button,
            "frame_check": checked}


def desktop_toolset(display: str | None = None, ocr: OcrEngine | None = None,
                    session_bus: str | None = None) -> ToolSet:
    """A fresh desktop tool set on `display` (default: $DISPLAY), or, with no X display, on the sway session
    of $WAYLAND_DISPLAY / $SWAYSOCK; `MissingDependency` if it cannot run (saying what a Wayland compositor
    offers when it is another one).

    `ocr` lets several tool sets share one loaded engine (tests, benchmarks); by default each set
    creates its own, loaded on first use. `session_bus` is the D-Bus session bus whose org.a11y.Bus
    names the accessibility bus (default $DBUS_SESSION_BUS_ADDRESS).
    """
    display = display if display is not None else os.environ.get("DISPLAY")
    wm = None
    if not display and os.environ.get("WAYLAND_DISPLAY") and module_problem() is None:
        from tether.tools.desktop.sway import SwayWm
        from tether.tools.desktop.wayland import sway_problem

        if sway_problem() is None:
            wm = SwayWm(dict(os.environ))
    if wm is None:
        problem = desktop_problem(display)
        if problem:
            raise MissingDependency(problem)
    from tether.tools.desktop.ui import ui_tools

    desk = Desktop(display or "", ocr, session_bus, wm)

    async def release() -> None:
        if wm is not None:
            wm.close()
        if ocr is None:  # an engine passed in belongs to the caller
            desk.ocr.close()

    return ToolSet("desktop", [screenshot_tool(desk.wm, desk.frames.add), *desktop_tools(desk), *ui_tools(desk)],
                   description="screen capture, the accessibility tree (AT-SPI) or OCR of on-screen text, mouse "
                               "and keyboard on an X11 display",
                   on_close=release)
