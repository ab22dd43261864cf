"""Acting on accessible elements: which window a call means, finding an element by role and name, and
pressing, typing into or focusing one through AT-SPI (Action.DoAction, EditableText, Component.GrabFocus).

Which window: a named `app` matches an application's name or a window's title (case-insensitive,
contained); with no name, the X11 active window is matched by its process id and title; failing both,
a window whose state is ACTIVE, and failing that the only window showing. None found means the
application exposes no accessibility tree, and the tools fall back to the screen (OCR, coordinates).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.tools.desktop.a11y.bus import A11yError, Session
from tether.tools.desktop.a11y.tree import (
    ACTION,
    COMPONENT,
    EDITABLE_TEXT,
    TEXT,
    App,
    Element,
    applications,
)
from tether.tools.desktop.ocr import match_score, normalize

if TYPE_CHECKING:
    from tether.tools.desktop.x11 import Window

PREFERRED_ACTIONS = ("click", "press", "activate", "toggle", "jump", "open", "select")
# roles whose elements are worth clicking by name even when they list no action
CLICKABLE_ROLES = {"push button", "toggle button", "check box", "radio button", "menu item", "link", "page tab",
                   "list item", "table cell", "combo box", "check menu item", "radio menu item"}


async def find_window(s: Session, app: str | None, active: Window | None) -> tuple[App, Element, str] | None:
    """The application and top-level window a call means (see the module docstring), and how it was
    chosen; None when no accessible application matches."""
    apps = await applications(s)
    pairs = [(a, w) for a in apps for w in a.windows]
    showing = [(a, w) for a, w in pairs if "showing" in w.states]
    if app:
        needle = normalize(app)
        named = [(a, w) for a, w in pairs if needle in normalize(a.name) or needle in normalize(w.name)]
        named.sort(key=lambda p: ("active" not in p[1].states, "showing" not in p[1].states))
        return (*named[0], "named") if named else None
    if active is not None:
        mine = [(a, w) for a, w in showing if active.pid is not None and a.pid == active.pid]
        for a, w in mine:
            if w.name == active.title:
                return a, w, "the active X11 window (pid and title)"
        if len(mine) == 1:
            return (*mine[0], "the active X11 window (pid)")
        for a, w in showing:
            if w.name and w.name == active.title:
                return a, w, "the active X11 window (title)"
    for a, w in showing:
        if "active" in w.states:
            return a, w, "the window whose state is active"
    if active is None and len(showing) == 1:
        return (*showing[0], "the only window showing")
    return None


def actionable(el: Element) -> bool:
    return bool(el.actions) or el.role in CLICKABLE_ROLES


def by_role_and_name(elements: list[Element], role: str | None, name: str | None) -> list[Element]:
    """Elements whose role is `role` (or ends with it: "button" finds "push button") and whose name is
    `name` (case-insensitive; when none is equal, those that contain it), showing ones first."""
    found = elements
    if role:
        r = normalize(role)
        found = [e for e in found if normalize(e.role) == r or normalize(e.role).endswith(" " + r)]
    if name:
        n = normalize(name)
        exact = [e for e in found if normalize(e.name) == n]
        found = exact or [e for e in found if n in normalize(e.name)]
    return sorted(found, key=lambda e: ("showing" not in e.states, not actionable(e)))


def rank_by_name(label: str, elements: list[Element]) -> list[tuple[float, Element]]:
    """Named elements scored against `label` (ocr.match_score), best first; actionable ones win ties.
    Top-level windows are left out: their name is a title, not something to click."""
    scored = [(match_score(label, e.name)[0], e) for e in elements
              if e.name and "showing" in e.states and e.role not in ("frame", "window", "application")]
    scored.sort(key=lambda p: (-p[0], not actionable(p[1]), p[1].depth))
    return scored


async def do_action(s: Session, el: Element, action: str | None = None) -> str:
    """Run one of `el`'s actions (by name, any case; default the first of PREFERRED_ACTIONS it has, else its first)."""
    if not el.has(ACTION) or not el.actions:
        raise A11yError(f"{el.id} ({el.role} {el.name!r}) has no accessible actions")
    lowered = [a.casefold() for a in el.actions]
    if action is not None:
        if action.casefold() not in lowered:
            raise A11yError(f"{el.id} ({el.role} {el.name!r}) has no action {action!r}; it has {el.actions}",
                            {"actions": el.actions})
        index = lowered.index(action.casefold())
    else:
        index = next((lowered.index(a) for a in PREFERRED_ACTIONS if a in lowered), 0)
    name = el.actions[index]
    (done,) = await s.call(el.ref, ACTION, "DoAction", "i", (index,))
    if not done:
        raise A11yError(f"{el.id} ({el.role} {el.name!r}) refused its action {name!r}")
    return name


async def read_text(s: Session, el: Element) -> str:
    """All of an element's text (Text interface)."""
    count = int(await s.prop(el.ref, TEXT, "CharacterCount"))
    (content,) = await s.call(el.ref, TEXT, "GetText", "ii", (0, count))
    return str(content)


async def write_text(s: Session, el: Element, text: str, replace: bool) -> str:
    """Append `text` to the element's text (or replace the whole content) through EditableText; the text
    after. The end, not the caret: where a caret sits in a field that has no focus is not what a caller sees."""
    if not el.has(EDITABLE_TEXT) or "editable" not in el.states:
        raise A11yError(f"{el.id} ({el.role} {el.name!r}) is not editable text")
    if replace:
        (done,) = await s.call(el.ref, EDITABLE_TEXT, "SetTextContents", "s", (text,))
    else:
        end = int(await s.prop(el.ref, TEXT, "CharacterCount"))
        (done,) = await s.call(el.ref, EDITABLE_TEXT, "InsertText", "isi", (end, text, len(text)))
    if not done:
        raise A11yError(f"{el.id} ({el.role} {el.name!r}) refused the text")
    return await read_text(s, el)


async def grab_focus(s: Session, el: Element) -> bool:
    """Give `el` the keyboard focus (Component.GrabFocus); whether the application said it did."""
    if not el.has(COMPONENT):
        return False
    (done,) = await s.call(el.ref, COMPONENT, "GrabFocus")
    return bool(done)
