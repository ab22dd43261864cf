"""The actions of `browser.act`: one function per `action`, and the table that names them.

Each action gets the live `Session` and the validated `Args` and returns only its own fields; the
envelope every answer shares (ok, sessionId, url, title, executionTime, error), the deadline and the
policy check of where the tab ended up belong to `tether.tools.browser.tool`. Keeping the two apart means
an action cannot forget any of those, and adding one is a function and a row in `ACTIONS`.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import json
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from tether.tools.browser.keys import key_name, split_keys
from tether.tools.browser.session import REF_PATTERN, Session, snapshot_refs
from tether.tools.browser.urls import check_url
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.policy.jail import approval_needed, resolve_path

if TYPE_CHECKING:
    from playwright.async_api import Locator

WaitUntil = Literal["load", "domcontentloaded", "networkidle", "commit"]
ElementState = Literal["attached", "detached", "visible", "hidden"]


@dataclass(frozen=True, slots=True)
class Args:
    """The validated arguments of one call, handed to the action."""

    action: str
    url: str | None
    selector: str | None
    ref: str | None
    text: str | None
    value: str | None
    values: list[str] | None
    key: str | None
    attribute: str | None
    expression: str | None
    x: float | None
    y: float | None
    deltaY: float | None
    path: str | None
    fullPage: bool
    waitUntil: WaitUntil
    state: ElementState
    button: Literal["left", "right", "middle"]
    clickCount: int
    delayMs: int
    timeoutMs: int

    @property
    def what(self) -> str:
        return f"ref {self.ref}" if self.ref else repr(self.selector) if self.selector else "the page"


def _need(value: Any, name: str, action: str) -> Any:
    if value is None or value == "":
        raise ToolError(f"{action} needs '{name}'")
    return value


def _target(s: Session, a: Args) -> Locator:
    """The element `selector` or `ref` names; a ref must come from a snapshot of the current document."""
    if a.ref:
        if not REF_PATTERN.fullmatch(a.ref):
            raise ToolError(f"ref {a.ref!r} is not a snapshot reference (they look like e12)")
        if a.ref not in s.refs:
            raise ToolError(f"ref {a.ref} is unknown: take a snapshot first and use one of its refs")
        if s.snapshot_document != s.document:
            raise ToolError(f"ref {a.ref} is stale: the page has changed since the snapshot; take a new snapshot")
        return s.page.locator(f"aria-ref={a.ref}")
    if a.selector:
        return s.page.locator(a.selector)
    raise ToolError(f"{a.action} needs 'selector' or 'ref'")


async def _press_steps(s: Session, steps: list[tuple[bool, str]], delay: int) -> None:
    for is_key, value in steps:
        if is_key:
            await s.page.keyboard.press(value, delay=delay or None)
        elif value:
            await s.page.keyboard.type(value, delay=delay or None)


# ---------------------------------------------------------------- actions (each returns its own fields)

async def _navigate(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    url = check_url(ctx.policy, _need(a.url, "url", a.action))
    response = await s.page.goto(url, wait_until=a.waitUntil, timeout=a.timeoutMs)
    return {"status": response.status if response else None}


async def _history(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    move = {"back": s.page.go_back, "forward": s.page.go_forward}[a.action]
    response = await move(wait_until=a.waitUntil, timeout=a.timeoutMs)
    return {"moved": response is not None}


async def _reload(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    response = await s.page.reload(wait_until=a.waitUntil, timeout=a.timeoutMs)
    return {"status": response.status if response else None}


async def _click(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    if a.selector is None and a.ref is None and a.x is not None and a.y is not None:
        await s.page.mouse.click(a.x, a.y, button=a.button, click_count=a.clickCount)
        return {"clicked": [a.x, a.y]}
    await _target(s, a).click(button=a.button, click_count=a.clickCount, timeout=a.timeoutMs)
    return {"clicked": a.what}


async def _hover(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    await _target(s, a).hover(timeout=a.timeoutMs)
    return {}


async def _type(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    steps = split_keys(_need(a.text, "text", a.action))
    if a.selector or a.ref:
        await _target(s, a).focus(timeout=a.timeoutMs)
    await _press_steps(s, steps, a.delayMs)
    return {"typed": a.text}


async def _fill(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    steps = split_keys(a.text if a.text is not None else (a.value or ""))
    first = steps.pop(0)[1] if steps and not steps[0][0] else ""
    await _target(s, a).fill(first, timeout=a.timeoutMs)  # replaces the content and focuses the field
    await _press_steps(s, steps, a.delayMs)
    return {"filled": a.what}


async def _press(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    key = key_name(_need(a.key, "key", a.action))
    if a.selector or a.ref:
        await _target(s, a).press(key, timeout=a.timeoutMs)
    else:
        await s.page.keyboard.press(key)
    return {"key": key}


async def _select(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    wanted = a.values if a.values else [_need(a.value, "value", a.action)]
    selected = await _target(s, a).select_option(wanted, timeout=a.timeoutMs)
    return {"value": selected}


async def _check(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    target = _target(s, a)
    await target.set_checked(a.action == "check", timeout=a.timeoutMs)
    return {"value": await target.is_checked(timeout=a.timeoutMs)}


async def _scroll(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    """An element into view; the wheel at (x, y) (scrolls what is under it); or the window by deltaY."""
    if a.selector or a.ref:
        await _target(s, a).scroll_into_view_if_needed(timeout=a.timeoutMs)
    elif a.x is not None and a.y is not None:
        await s.page.mouse.move(a.x, a.y)
        await s.page.mouse.wheel(0, a.deltaY or 0)
    elif a.deltaY is not None:
        await s.page.evaluate("dy => window.scrollBy({top: dy, behavior: 'instant'})", a.deltaY)
    else:
        raise ToolError("scroll needs 'selector' or 'ref', 'deltaY', or 'x', 'y' and 'deltaY'")
    position = await s.page.evaluate("() => [window.scrollX, window.scrollY]")
    return {"scrollX": position[0], "scrollY": position[1]}


async def _wait_selector(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    await _target(s, a).wait_for(state=a.state, timeout=a.timeoutMs)
    return {"state": a.state}


async def _wait_navigation(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    """Until the URL contains (or glob-matches) `url`, if given; then until the load state is reached."""
    if a.url:
        pattern = a.url
        await s.page.wait_for_url(lambda u: pattern in u or fnmatch.fnmatchcase(u, pattern),
                                  wait_until=a.waitUntil, timeout=a.timeoutMs)
    else:
        await s.page.wait_for_load_state(a.waitUntil if a.waitUntil != "commit" else "load", timeout=a.timeoutMs)
    return {}


async def _get_text(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    return _capped(ctx, await _target(s, a).inner_text(timeout=a.timeoutMs))


async def _page_text(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    return _capped(ctx, await s.page.locator("body").inner_text(timeout=a.timeoutMs))


async def _get_attribute(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    name = _need(a.attribute, "attribute", a.action)
    return {"value": await _target(s, a).get_attribute(name, timeout=a.timeoutMs)}


async def _get_url(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    return {"value": s.page.url}


def allow_evaluate(ctx: ToolContext) -> None:
    if not ctx.policy.browser_allow_evaluate:
        raise PolicyDenied("browser.evaluate", "running the agent's JavaScript in the page is off "
                                               "(set browser_allow_evaluate: true to allow it)")


async def _evaluate(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    allow_evaluate(ctx)
    value = await s.page.evaluate(_need(a.expression, "expression", a.action))
    text = json.dumps(value, default=repr)
    if len(text) > ctx.policy.max_output_bytes:
        return {"value": text[: ctx.policy.max_output_bytes], "truncated": True}
    return {"value": value}


async def _screenshot(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    if a.selector or a.ref:
        png = await _target(s, a).screenshot(type="png", timeout=a.timeoutMs)
    else:
        png = await s.page.screenshot(type="png", full_page=a.fullPage, timeout=a.timeoutMs)
    width, height = struct.unpack(">II", png[16:24])
    out: dict[str, Any] = {"width": width, "height": height, "bytes": len(png)}
    if a.path:
        target = resolve_path(ctx.policy, a.path, write=True, hidden=ctx.secrets)
        if target.exists():
            rule = approval_needed(ctx.policy, "overwrite", target, ctx.temp_dir)
            if rule and not ctx.approved_by:
                raise NeedsApproval(rule, f"the screenshot would overwrite {str(target)!r}")

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(png)

        await asyncio.to_thread(write)
        out["path"] = str(target)
    else:
        out["base64"] = base64.b64encode(png).decode("ascii")
    return out


async def _snapshot(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    """The page's ARIA tree (Playwright's AI mode); each `[ref=eN]` works as `ref` until the page changes."""
    if a.selector or a.ref:
        raise ToolError("snapshot covers the whole page and takes no selector or ref")
    document = s.document
    text = await s.page.aria_snapshot(mode="ai", timeout=a.timeoutMs)
    s.refs, s.snapshot_document = snapshot_refs(text), document
    out = _capped(ctx, text)
    out["refs"] = len(s.refs)
    return out


async def _new_page(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    url = check_url(ctx.policy, a.url) if a.url else None
    page = await s.context.new_page()
    if s.owner is not None:
        s.owner.adopt(s, page)  # usually done already by the context's "page" handler; idempotent
    if url:
        response = await s.page.goto(url, wait_until=a.waitUntil, timeout=a.timeoutMs)
        return {"status": response.status if response else None}
    return {}


def _capped(ctx: ToolContext, text: str) -> dict[str, Any]:
    limit = ctx.policy.max_output_bytes
    return {"value": text[:limit], "truncated": True} if len(text) > limit else {"value": text}


REPEATABLE = frozenset({"waitForSelector", "waitForNavigation", "getText", "getPageText", "getAttribute", "getUrl",
                        "screenshot", "snapshot"})
ActionFn = Callable[[ToolContext, Session, Args], Awaitable[dict[str, Any]]]
ACTIONS: MappingProxyType[str, ActionFn] = MappingProxyType({
    "navigate": _navigate, "back": _history, "forward": _history, "reload": _reload, "click": _click,
    "hover": _hover, "type": _type, "fill": _fill, "press": _press, "select": _select, "check": _check,
    "uncheck": _check, "scroll": _scroll, "waitForSelector": _wait_selector, "waitForNavigation": _wait_navigation,
    "getText": _get_text, "getPageText": _page_text, "getAttribute": _get_attribute, "getUrl": _get_url,
    "evaluate": _evaluate, "screenshot": _screenshot, "snapshot": _snapshot, "newPage": _new_page,
})
