"""The `ui.*` skills of seed 004 on X11: findAndClick, typeText, waitFor.

They are built from the same pieces as the plain desktop tools (grab, OCR, xdotool) but do what a
planner means in one call: find a label and click it, type text with key tokens, or wait until
something is on screen. Waiting polls (each poll is a screenshot and, for text, an OCR pass of a few
hundred milliseconds) and always ends: when the condition holds, or at `timeoutMs` with a failure
that says what it saw last, so recovery can decide or ask the user.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from tether.tools.desktop.keys import Button, TokenError, parse_typed_text
from tether.tools.desktop.ocr import Match, joined_text, normalize, rank
from tether.tools.desktop.screen import Capture, grab
from tether.tools.errors import ToolError
from tether.tools.runtime import ToolFunction, tool

if TYPE_CHECKING:
    from tether.tools.desktop.desk import Desktop
    from tether.tools.desktop.x11 import Window

Condition = Literal["textIncludes", "textRegex", "appIsActive", "titleIncludes", "urlIncludes", "changed"]
FIND_POLL_S = 0.2
CANDIDATES = 5
CHANGE_PIXEL_DELTA = 24  # a channel must move by more than this to count (ignores dithering/antialias noise)
DEFAULT_CHANGE_FRACTION = 0.001
ADDRESS_BAR_PX = 140  # urlIncludes reads the top of a browser window, where the address bar is
_EXCERPT = 400


def _excerpt(text: str) -> str:
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "..."


def changed_fraction(before: Capture, after: Capture) -> float:
    """Share of pixels whose colour moved by more than CHANGE_PIXEL_DELTA in some channel (1.0 if the
    sizes differ, e.g. the window was resized)."""
    import numpy as np

    if (before.width, before.height) != (after.width, after.height):
        return 1.0
    a = np.frombuffer(before.bgra, np.uint8).reshape(before.height, before.width, 4)[:, :, :3]
    b = np.frombuffer(after.bgra, np.uint8).reshape(after.height, after.width, 4)[:, :, :3]
    moved = np.abs(a.astype(np.int16) - b.astype(np.int16)).max(axis=2) > CHANGE_PIXEL_DELTA
    return float(np.count_nonzero(moved)) / moved.size


def _window_names(win: Window | None) -> dict[str, Any]:
    if win is None:
        return {"title": None, "wm_class": [], "process": None, "pid": None}
    process = None
    if win.pid is not None:
        import psutil

        try:
            process = psutil.Process(win.pid).name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            process = None
    return {"title": win.title, "wm_class": win.wm_class, "process": process, "pid": win.pid}


def _contains(win: Window, x: int, y: int) -> bool:
    return win.x <= x < win.x + win.width and win.y <= y < win.y + win.height


async def _window_at_pointer(desk: Desktop) -> Window | None:
    """Best effort: the click may well have closed the window it landed on."""
    try:
        wid = await desk.wm.window_at_pointer()
        return await desk.wm.window(wid) if wid is not None else None
    except ToolError:
        return None


def ui_tools(desk: Desktop) -> list[ToolFunction]:
    """`ui.findAndClick`, `ui.typeText` and `ui.waitFor` bound to one `Desktop`."""

    @tool("ui.findAndClick", tool_type="action", timeout=180)
    async def find_and_click(label: str, app: str | None = None,
                             confidence: Annotated[float, Field(ge=0, le=1)] = 0.8,
                             button: Button = "left",
                             timeoutMs: Annotated[int, Field(ge=0, le=120_000)] = 5000,
                             via: Literal["auto", "accessibility", "ocr"] = "auto",
                             role: str | None = None,
                             ) -> dict[str, Any]:
        """Find `label` and click it: first among the accessible elements' names of the active window (or
        of `app`), pressed through their AT-SPI action (`role` narrows them); where no element matches or
        the application exposes no tree, on screen by OCR (fuzzy, score ≥ `confidence`), clicked at its
        centre; with `app`, only inside the window whose title or class contains it (brought forward
        first). `via` forces one way; the answer's `via` says which was used. Retries until `timeoutMs`;
        when nothing matches it fails listing the closest candidates and their scores."""
        if not normalize(label):
            raise ToolError("label is empty")
        started = time.perf_counter()
        deadline = time.monotonic() + timeoutMs / 1000
        attempts = 0
        a11y_seen: dict[str, Any] = {}
        while True:
            attempts += 1
            if via != "ocr":
                pressed = await _find_accessible(desk, label, app, role, confidence, button, a11y_seen)
                if pressed is not None:
                    return {**pressed, "label": label, "attempts": attempts,
                            "elapsed_ms": round((time.perf_counter() - started) * 1e3, 1)}
                if via == "accessibility":
                    if time.monotonic() >= deadline:
                        raise ToolError(f"no accessible element matching {label!r} with score >= {confidence} "
                                        f"after {attempts} attempt(s): {a11y_seen.get('why')}", a11y_seen)
                    await asyncio.sleep(min(FIND_POLL_S, max(0.0, deadline - time.monotonic())))
                    continue
            try:
                window = await desk.app_window(app) if app else None
            except ToolError:  # the app's window is not there (yet): keep looking until the deadline
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(min(FIND_POLL_S, max(0.0, deadline - time.monotonic())))
                continue
            region = window.region if window is not None else None
            read = desk.read_screen(region)
            if window is None:
                (capture, elements, timings), window = await asyncio.gather(read, desk.wm.active_window())
            else:
                capture, elements, timings = await read
            ranked = rank(label, elements)
            best: Match | None = ranked[0] if ranked else None
            if best is not None and best.score >= confidence:
                x, y = best.center
                t0 = time.perf_counter()
                await desk.click_at(x, y, button)
                timings["click"] = (time.perf_counter() - t0) * 1e3
                if window is None or not _contains(window, x, y):  # report the window that was clicked
                    window = await _window_at_pointer(desk)
                return {"via": "ocr", "why_not_accessibility": a11y_seen.get("why"),
                        "clicked": {**best.as_dict(), "center": {"x": x, "y": y}}, "label": label,
                        "score": round(best.score, 3), "button": button,
                        "window_title": window.title if window else None,
                        "window": window.as_dict() if window else None, "attempts": attempts,
                        "elapsed_ms": round((time.perf_counter() - started) * 1e3, 1),
                        "timings_ms": {k: round(v, 1) for k, v in timings.items()}}
            if time.monotonic() >= deadline:
                candidates = [m.as_dict() for m in ranked[:CANDIDATES]]
                listing = ", ".join(f"{c['text']!r} ({c['score']})" for c in candidates) or "no text at all"
                where = f" in window {window.title!r}" if app and window else " on screen"
                raise ToolError(f"no text matching {label!r} with score >= {confidence}{where} after {attempts} "
                                f"attempt(s) in {timeoutMs} ms; closest: {listing}",
                                {"label": label, "candidates": candidates, "attempts": attempts,
                                 "window_title": window.title if window else None, "captured": capture.region})
            await asyncio.sleep(min(FIND_POLL_S, max(0.0, deadline - time.monotonic())))

    @tool("ui.typeText", tool_type="action", timeout=300)
    async def type_text_tokens(text: str,
                               delayMs: Annotated[int, Field(ge=0, le=1000)] = 30,
                               ) -> dict[str, Any]:
        """Type `text` into the focused window; `{ENTER}` `{TAB}` `{ESC}` `{BACKSPACE}` `{UP}` `{DOWN}`
        `{LEFT}` `{RIGHT}` press keys, `{CTRL+C}` / `{CMD+K}` (CMD = Super) press combinations, and
        `{{` / `}}` type literal braces. The whole text is checked before anything is typed."""
        try:
            segments = parse_typed_text(text)
        except TokenError as exc:
            raise ToolError(f"nothing was typed: {exc}") from None
        chars = sum(len(s.value) for s in segments if s.kind == "text")
        if chars * (delayMs + 5) > 280_000:
            raise ToolError(f"{chars} characters at {delayMs} ms each would take too long; split the text")
        keys: list[str] = []
        async with desk.input_lock:
            for seg in segments:
                if seg.kind == "key":
                    keys.append(seg.value)
                    continue
                if keys:  # consecutive keys go in one call
                    await desk.press(keys, delayMs, locked=True)
                    keys = []
                await desk.type_literal(seg.value, delayMs)
            if keys:
                await desk.press(keys, delayMs, locked=True)
        return {"typed_chars": chars, "keys": [s.value for s in segments if s.kind == "key"],
                "segments": [{"kind": s.kind, "value": s.value} for s in segments]}

    @tool("ui.waitFor", tool_type="data_collection", timeout=660)
    async def wait_for(condition: Condition, value: str = "",
                       timeoutMs: Annotated[int, Field(ge=0, le=600_000)] = 10_000,
                       pollIntervalMs: Annotated[int, Field(ge=50, le=60_000)] = 500,
                       activeWindow: bool = False) -> dict[str, Any]:
        """Wait until a condition holds: `textIncludes` / `textRegex` (OCR of the screen, or of the active
        window), `appIsActive` (active window's title, class or process name contains `value`),
        `titleIncludes`, `urlIncludes` (a browser's title or address bar, read by OCR: X11 exposes no
        URL), or `changed` (the screen differs from the first look; `value` = minimum changed share of
        pixels, default 0.001). Fails at `timeoutMs` with what it saw last."""
        check = _make_check(desk, condition, value, activeWindow)
        started = time.monotonic()
        deadline = started + timeoutMs / 1000
        polls = 0
        state: dict[str, Any] = {}
        while True:
            polls += 1
            poll_start = time.monotonic()
            met, seen = await check(state)
            if met:
                return {"condition": condition, "value": value, "met": True, "polls": polls,
                        "elapsed_ms": round((time.monotonic() - started) * 1e3), "seen": seen}
            now = time.monotonic()
            if now >= deadline:
                shown = seen.get("text") if isinstance(seen.get("text"), str) else seen
                raise ToolError(f"{condition} {value!r} not met within {timeoutMs} ms ({polls} checks); "
                                f"last saw: {shown!r}",
                                {"condition": condition, "value": value, "met": False, "polls": polls,
                                 "last_seen": seen})
            await asyncio.sleep(max(0.0, min(poll_start + pollIntervalMs / 1000, deadline) - now))

    return [find_and_click, type_text_tokens, wait_for]


async def _find_accessible(desk: Desktop, label: str, app: str | None, role: str | None, confidence: float,
                           button: Button, seen: dict[str, Any]) -> dict[str, Any] | None:
    """One accessibility attempt of ui.findAndClick: press the best-named element, or None (and `seen`
    says why: no bus, no tree for this window, or the closest names)."""
    from tether.tools.desktop.a11y.act import by_role_and_name, do_action, rank_by_name
    from tether.tools.desktop.a11y.bus import A11yError
    from tether.tools.desktop.a11y.view import window_tree

    t0 = time.perf_counter()
    try:
        async with desk.a11y.session() as s:
            got = await window_tree(desk, s, app)
            if got is None:
                seen["why"] = f"no accessible application matches {app or 'the active window'}"
                return None
            application, window, _how, elements, _cut = got
            pool = by_role_and_name(elements, role, None) if role else elements
            ranked = rank_by_name(label, pool)
            if not ranked or ranked[0][0] < confidence:
                seen["why"] = f"no element of {window.name!r} is named like {label!r}"
                seen["candidates"] = [{"id": e.id, "role": e.role, "name": e.name, "score": round(sc, 3)}
                                      for sc, e in ranked[:CANDIDATES]]
                return None
            score, el = ranked[0]
            t1 = time.perf_counter()
            result = {"score": round(score, 3), "button": button, "element": el.as_dict(), "window_title": window.name,
                      "application": application.name}
            if button == "left" and el.actions:
                action = await do_action(s, el, None)
                timings = {"tree": (t1 - t0) * 1e3, "action": (time.perf_counter() - t1) * 1e3}
                return {"via": "accessibility", "action": action, **result,
                        "timings_ms": {k: round(v, 1) for k, v in timings.items()}}
    except A11yError as exc:
        seen["why"] = str(exc)
        return None
    if el.center is None:
        seen["why"] = f"{el.id} has no action and no position on screen"
        return None
    x, y = el.center
    await desk.click_at(x, y, button)
    return {"via": "coordinates", "why": "no accessible action" if not el.actions else f"{button} is a pointer click",
            **result, "x": x, "y": y}


def _make_check(desk: Desktop, condition: Condition, value: str, active_window: bool) -> Any:
    """One poll of `condition`: an async function returning (met, what was seen)."""
    if condition in ("textIncludes", "textRegex", "appIsActive", "titleIncludes", "urlIncludes") and not value:
        raise ToolError(f"{condition} needs a non-empty 'value'")
    needle = normalize(value)

    async def region() -> dict[str, int] | None:
        if not active_window:
            return None
        win = await desk.wm.active_window()
        return win.region if win is not None else None

    if condition in ("textIncludes", "textRegex"):
        pattern = None
        if condition == "textRegex":
            try:
                pattern = re.compile(value)
            except re.error as exc:
                raise ToolError(f"textRegex: invalid regular expression {value!r}: {exc}") from None

        async def check_text(_state: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
            _capture, elements, _ = await desk.read_screen(await region())
            text = joined_text(elements)
            if pattern is not None:
                found = pattern.search(text)
                hits = [e.as_dict() for e in elements if pattern.search(e.text)]
                return found is not None, {"text": _excerpt(text), "match": found.group(0) if found else None,
                                           "elements": hits}
            hits = [e.as_dict() for e in elements if needle in normalize(e.text)]
            met = bool(hits) or needle in normalize(" ".join(e.text for e in elements))
            return met, {"text": _excerpt(text), "elements": hits}

        return check_text

    if condition in ("appIsActive", "titleIncludes"):
        async def check_window(_state: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
            names = _window_names(await desk.wm.active_window())
            fields = [names["title"] or ""] if condition == "titleIncludes" else \
                [names["title"] or "", *names["wm_class"], names["process"] or ""]
            return any(needle in normalize(f) for f in fields), names

        return check_window

    if condition == "urlIncludes":
        async def check_url(_state: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
            win = await desk.wm.active_window()
            if win is None:
                return False, {"title": None, "address_bar": None}
            if needle in normalize(win.title):
                return True, {"title": win.title, "address_bar": None}
            top = {"x": win.x, "y": win.y, "width": win.width, "height": min(win.height, ADDRESS_BAR_PX)}
            _capture, elements, _ = await desk.read_screen(top)
            bar = " ".join(e.text for e in elements)
            squeezed = normalize(bar).replace(" ", "")
            return needle.replace(" ", "") in squeezed, {"title": win.title, "address_bar": _excerpt(bar)}

        return check_url

    try:
        threshold = float(value) if value else DEFAULT_CHANGE_FRACTION
    except ValueError:
        raise ToolError(f"changed: 'value' is the minimum changed share of pixels (e.g. 0.01), not {value!r}") \
            from None
    if not 0 < threshold <= 1:
        raise ToolError(f"changed: 'value' must be in (0, 1], got {threshold}")

    async def check_changed(state: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        if "baseline" not in state:
            state["region"] = await region()
            state["baseline"] = await grab(desk.wm, state["region"])
            return False, {"changed_fraction": 0.0, "threshold": threshold, "captured": state["baseline"].region}
        now = await grab(desk.wm, state["region"])
        fraction = await asyncio.to_thread(changed_fraction, state["baseline"], now)
        return fraction > threshold, {"changed_fraction": round(fraction, 5), "threshold": threshold,
                                      "captured": now.region}

    return check_changed
