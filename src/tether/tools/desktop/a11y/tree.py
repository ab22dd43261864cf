"""Reading the accessibility tree: the applications on the bus, their windows, and the elements of one.

An element is read with a handful of calls (role, name, states, interfaces, children, then bounds and
action names where it has them); the calls of one level of the tree are sent together, so a window
costs a few round trips per level rather than per element. Hidden subtrees (not SHOWING) and the
children of objects that manage their descendants (huge tables) are not descended into; `max_elements`
bounds the whole walk and the answer says when it was cut.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from tether.tools.desktop.a11y.bus import ACCESSIBLE, REGISTRY, ROOT_PATH, A11yError, Ref, Session

COMPONENT = "org.a11y.atspi.Component"
ACTION = "org.a11y.atspi.Action"
TEXT = "org.a11y.atspi.Text"
EDITABLE_TEXT = "org.a11y.atspi.EditableText"
SCREEN_COORDS = 0
TEXT_LIMIT = 200
STATES = (
    "invalid", "active", "armed", "busy", "checked", "collapsed", "defunct", "editable", "enabled", "expandable",
    "expanded", "focusable", "focused", "has_tooltip", "horizontal", "iconified", "modal", "multi_line",
    "multiselectable", "opaque", "pressed", "resizable", "selectable", "selected", "sensitive", "showing",
    "single_line", "stale", "transient", "vertical", "visible", "manages_descendants", "indeterminate", "required",
    "truncated", "animated", "invalid_entry", "supports_autocompletion", "selectable_text", "is_default", "visited",
    "checkable", "has_popup", "read_only",
)


def state_names(words: list[int] | tuple[int, ...]) -> list[str]:
    """AT-SPI's state set (two 32-bit words, bit n = state n) as names."""
    bits = sum(int(w) << (32 * i) for i, w in enumerate(words))
    return [name for i, name in enumerate(STATES) if bits >> i & 1]


@dataclass(slots=True)
class Element:
    """One accessible object as the tools report it; `ref` is where it lives on the bus."""

    ref: Ref
    role: str
    name: str
    states: list[str]
    interfaces: list[str]
    depth: int = 0
    parent: str | None = None
    bounds: dict[str, int] | None = None
    actions: list[str] = field(default_factory=list)
    text: str | None = None
    description: str = ""
    children: list[Ref] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.ref.id

    @property
    def center(self) -> tuple[int, int] | None:
        b = self.bounds
        return (b["x"] + b["width"] // 2, b["y"] + b["height"] // 2) if b else None

    def has(self, interface: str) -> bool:
        return interface in self.interfaces

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "role": self.role, "name": self.name, "states": self.states,
                               "bounds": self.bounds, "actions": self.actions, "depth": self.depth,
                               "parent": self.parent}
        if self.text is not None:
            out["text"] = self.text
        if self.description:
            out["description"] = self.description
        if self.has(EDITABLE_TEXT):
            out["editable"] = True
        return out


async def read_element(s: Session, ref: Ref, depth: int = 0, parent: str | None = None,
                       details: bool = True) -> Element:
    """One element: role, name, states, interfaces and children; with `details`, its bounds, action
    names and (for text) its first TEXT_LIMIT characters too."""
    role, name, state, ifaces, kids = await asyncio.gather(
        s.call(ref, ACCESSIBLE, "GetRoleName"), s.prop(ref, ACCESSIBLE, "Name"), s.call(ref, ACCESSIBLE, "GetState"),
        s.call(ref, ACCESSIBLE, "GetInterfaces"), s.call(ref, ACCESSIBLE, "GetChildren"))
    el = Element(ref, str(role[0]), str(name or ""), state_names(state[0]), [str(i) for i in ifaces[0]], depth, parent,
                 children=[Ref(str(b), str(p)) for b, p in kids[0]])
    if details:
        await _details(s, el)
    return el


async def _details(s: Session, el: Element) -> None:
    async def bounds() -> None:
        if el.has(COMPONENT):
            x, y, w, h = (await s.call(el.ref, COMPONENT, "GetExtents", "u", (SCREEN_COORDS,)))[0]
            el.bounds = {"x": int(x), "y": int(y), "width": int(w), "height": int(h)}

    async def actions() -> None:
        if el.has(ACTION):
            (listed,) = await s.call(el.ref, ACTION, "GetActions")
            el.actions = [str(a[0]) for a in listed]

    async def text() -> None:
        if el.has(TEXT) and el.role not in ("label", "push button", "check box", "radio button", "menu item"):
            (content,) = await s.call(el.ref, TEXT, "GetText", "ii", (0, TEXT_LIMIT))
            el.text = str(content)

    results = await asyncio.gather(bounds(), actions(), text(), return_exceptions=True)
    for r in results:  # an element that vanished mid-read keeps what was read; anything else is a bug
        if isinstance(r, BaseException) and not isinstance(r, A11yError):
            raise r


@dataclass(frozen=True, slots=True)
class App:
    """An application on the accessibility bus and its top-level windows (frames, dialogs)."""

    ref: Ref
    name: str
    pid: int | None
    windows: list[Element]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "id": self.ref.id,
                "windows": [{"id": w.id, "role": w.role, "name": w.name, "states": w.states, "bounds": w.bounds}
                            for w in self.windows]}


async def applications(s: Session) -> list[App]:
    """Every application registered on the bus, with its windows (an app that vanished is left out)."""
    (refs,) = await s.call(Ref(REGISTRY, ROOT_PATH), ACCESSIBLE, "GetChildren")

    async def one(bus: str, path: str) -> App | None:
        ref = Ref(str(bus), str(path))
        try:
            root = await read_element(s, ref, details=False)
            windows = await asyncio.gather(*(read_element(s, w, 1, root.id) for w in root.children))
            return App(ref, root.name, await s.pid_of(ref.bus), list(windows))
        except A11yError:
            return None

    return [a for a in await asyncio.gather(*(one(b, p) for b, p in refs)) if a is not None]


@dataclass(slots=True)
class Walk:
    """A window's elements in document order, and whether `max_elements` cut the walk short."""

    elements: list[Element]
    truncated: bool = False
    hidden_skipped: int = 0


async def walk(s: Session, top: Element, max_elements: int = 400, max_depth: int = 40,
               include_hidden: bool = False) -> Walk:
    """`top` and its descendants, level by level (each level's reads sent together), in document order."""
    out = Walk([top])
    order: dict[str, list[Element]] = {}
    level = [top]
    while level and len(out.elements) < max_elements:
        pending: list[tuple[Ref, int, str]] = []
        for el in level:
            if el.depth >= max_depth or "manages_descendants" in el.states:
                continue
            if not include_hidden and el is not top and "showing" not in el.states:
                out.hidden_skipped += 1
                continue
            pending += [(c, el.depth + 1, el.id) for c in el.children if not c.is_null]
        room = max_elements - len(out.elements)
        if len(pending) > room:
            pending, out.truncated = pending[:room], True
        read = await asyncio.gather(*(read_element(s, ref, d, p) for ref, d, p in pending), return_exceptions=True)
        level = []
        for r in read:
            if isinstance(r, Element):
                level.append(r)
                order.setdefault(r.parent or "", []).append(r)
                out.elements.append(r)
            elif not isinstance(r, A11yError):
                raise r
    # document order: depth-first from the top, children in the order their parent listed them
    ordered: list[Element] = []
    stack = [top]
    while stack:
        el = stack.pop()
        ordered.append(el)
        stack.extend(reversed(order.get(el.id, [])))
    out.elements = ordered
    return out
