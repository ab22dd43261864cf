"""The accessibility side of the desktop tools, on one `Desktop`: the tree of the window a call means,
and the element a call names (by id, or by role and name in that window).

`None` from these means "this application exposes no accessibility tree": the tools then fall back
to the screen (OCR, coordinates) and say so. An A11yError means the bus or the element failed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tether.tools.desktop.a11y.act import by_role_and_name, find_window
from tether.tools.desktop.a11y.bus import A11yError, Ref, Session
from tether.tools.desktop.a11y.tree import App, Element, read_element, walk
from tether.tools.desktop.screen import grab
from tether.tools.errors import ToolError

if TYPE_CHECKING:
    from tether.tools.desktop.desk import Desktop

LISTED = 30


async def window_tree(desk: Desktop, s: Session, app: str | None, max_elements: int = 400,
                      include_hidden: bool = False) -> tuple[App, Element, str, list[Element], bool] | None:
    """The application, window, how it was chosen, the window's elements and whether the walk was cut;
    None when no accessible application matches `app` (or the active window)."""
    active = None if app else await desk.wm.active_window()
    found = await find_window(s, app, active)
    if found is None:
        return None
    application, window, how = found
    w = await walk(s, window, max_elements=max_elements, include_hidden=include_hidden)
    return application, window, how, w.elements, w.truncated


async def accessible_tree(desk: Desktop, app: str | None, max_elements: int,
                          include_hidden: bool) -> tuple[dict[str, Any], str | None]:
    """`get_ui_tree`'s answer from the accessibility tree, or ({}, why not) when there is none to read."""
    t0 = time.perf_counter()
    async with desk.a11y.session() as s:
        got = await window_tree(desk, s, app, max_elements, include_hidden)
    if got is None:
        target = f"an application or window named {app!r}" if app else "the active window"
        return {}, f"no application on the accessibility bus matches {target}"
    application, window, how, elements, truncated = got
    t1 = time.perf_counter()
    capture = await grab(desk.wm, window.bounds) if window.bounds and window.bounds["width"] > 0 else \
        await grab(desk.wm)
    frame = desk.frames.add(capture)
    t2 = time.perf_counter()
    return {"source": "accessibility", "frame": frame, "matched_by": how,
            "application": {"name": application.name, "pid": application.pid, "id": application.ref.id},
            "window_title": window.name, "window": {"id": window.id, "role": window.role, "bounds": window.bounds,
                                                    "states": window.states},
            "elements": [e.as_dict() for e in elements], "count": len(elements), "truncated": truncated,
            "captured": capture.region,
            "timings_ms": {"tree": round((t1 - t0) * 1e3, 1), "screenshot": round((t2 - t1) * 1e3, 1)}}, None


async def resolve(desk: Desktop, s: Session, control_id: str | None, role: str | None, name: str | None,
                  app: str | None) -> Element | None:
    """The element an accessibility id names, or the best one with `role` and `name` in the window the
    call means; None when that window exposes no tree. A ToolError when the id is gone or nothing matches."""
    if control_id is not None:
        ref = Ref.from_id(control_id)
        if ref is None:
            raise ToolError(f"{control_id!r} is not an accessibility element id")
        try:
            return await read_element(s, ref)
        except A11yError as exc:
            raise A11yError(f"element {control_id} is gone or unreadable ({exc}); call get_ui_tree again",
                            {"stale": True}) from None
    got = await window_tree(desk, s, app)
    if got is None:
        return None
    _app, window, _how, elements, _cut = got
    matches = by_role_and_name(elements, role, name)
    if not matches:
        listed = [f"{e.role} {e.name!r}" for e in elements if e.name][:LISTED]
        raise ToolError(f"no element{' with role ' + repr(role) if role else ''}"
                        f"{' named ' + repr(name) if name else ''} in window {window.name!r}; named elements: "
                        f"{', '.join(listed) or '(none)'}", {"elements": listed})
    return matches[0]

