"""`browser.act`: seed 004's browser skill, Playwright driving the system Chromium.

One tool with an `action` argument, as the seed's payloads have it (`{"action": "navigate", "url": ...,
"sessionId": ...}`), so a planner learns one schema. Every action runs under `timeoutMs` and answers with
`ok, action, sessionId, url, title, executionTime` plus its value (`value` for anything read; a
screenshot's `base64` or `path`); a failure carries the same fields and `error`, so recovery sees where the
tab was. Elements are named by a CSS/Playwright `selector` or by a `ref` from the latest `snapshot` (the
page's ARIA tree); refs die with the document, and a stale one fails with that reason instead of
clicking something else. URLs go through the policy (`browser_allowed_schemes`, `browser_allowed_origins`),
and `evaluate` runs only when `browser_allow_evaluate` is set: the agent's JavaScript can do anything
the page can.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import json
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field

from tether.tools.browser_session import (
    NEUTRAL_URLS,
    REF_PATTERN,
    BrowserManager,
    Session,
    check_url,
    key_name,
    snapshot_refs,
    split_keys,
)
from tether.tools.context import ToolContext
from tether.tools.errors import NeedsApproval, PolicyDenied, ToolError
from tether.tools.jail import approval_needed, resolve_path
from tether.tools.runtime import ToolSet, tool

if TYPE_CHECKING:
    from playwright.async_api import Locator

Action = Literal["navigate", "back", "forward", "reload", "click", "hover", "type", "fill", "press", "select",
                 "check", "uncheck", "scroll", "waitForSelector", "waitForNavigation", "getText", "getPageText",
                 "getAttribute", "getUrl", "evaluate", "screenshot", "snapshot", "newPage", "closeSession"]
WaitUntil = Literal["load", "domcontentloaded", "networkidle", "commit"]
ElementState = Literal["attached", "detached", "visible", "hidden"]
TimeoutMs = Annotated[int, Field(ge=1, le=300_000)]
MAX_TIMEOUT_S = 300.0


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


def _allow_evaluate(ctx: ToolContext) -> None:
    if not ctx.policy.browser_allow_evaluate:
        raise PolicyDenied("browser.evaluate", "running the agent's JavaScript in the page is off "
                                               "(set browser_allow_evaluate: true to allow it)")


async def _evaluate(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    _allow_evaluate(ctx)
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
        target = resolve_path(ctx.policy, a.path, write=True)
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


# ---------------------------------------------------------------- running one call


def _reason(exc: PolicyDenied) -> str:
    return str(exc).removeprefix(f"denied by policy rule '{exc.rule}': ")


async def _check_where(ctx: ToolContext, s: Session) -> None:
    """Fail if the page opened (or tried to open) what the policy refuses; a refused page is left for about:blank."""
    if s.blocked:
        rule, url, reason = s.blocked[0]
        s.blocked.clear()
        raise PolicyDenied(rule, f"the page tried to open {url} and was stopped: {reason}")
    url = s.page.url
    if url in NEUTRAL_URLS:
        return
    try:
        check_url(ctx.policy, url)
    except PolicyDenied as exc:
        await s.page.goto("about:blank")
        raise PolicyDenied(exc.rule, f"the page went to {url} ({_reason(exc)}); the tab was reset to "
                                     "about:blank") from None


def _playwright_message(exc: BaseException, a: Args, s: Session | None) -> str:
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    if isinstance(exc, PlaywrightTimeout | TimeoutError):
        message = f"{a.action}: timed out after {a.timeoutMs} ms"
        if a.selector or a.ref:
            message += f" waiting for {a.what}"
        if a.ref and s is not None and s.snapshot_document != s.document:
            message += " (the page has changed since the snapshot: take a new one)"
        return message
    text = str(exc).split("Call log:")[0].strip()
    return f"{a.action}: {text[:1500]}"


async def _where(s: Session | None) -> dict[str, Any]:
    """The tab's URL and title, best effort: a hung or closing page must not turn an answer into a hang."""
    if s is None or s.page.is_closed():
        return {"url": None, "title": None}
    try:
        title = await asyncio.wait_for(s.page.title(), 2.0)
    except Exception:
        title = None
    return {"url": s.page.url, "title": title}


async def _perform(ctx: ToolContext, s: Session, a: Args) -> dict[str, Any]:
    """The action; a wait or read whose tab was swapped for a popup meanwhile is redone on the new tab
    (a link with target=_blank is announced only after the click returns, so `click` then
    `waitForNavigation` would otherwise race the swap)."""
    from playwright.async_api import Error as PlaywrightError

    page = s.page
    try:
        return await ACTIONS[a.action](ctx, s, a)
    except PlaywrightError:
        if a.action not in REPEATABLE or s.page is page or s.page.is_closed():
            raise
    return await ACTIONS[a.action](ctx, s, a)


async def run_action(manager: BrowserManager, ctx: ToolContext, a: Args, session_id: str,
                     headless: bool | None) -> dict[str, Any]:
    """One `browser.act` call: preflight policy checks, the session, the action under its deadline."""
    from playwright.async_api import Error as PlaywrightError

    started = time.perf_counter()
    head: dict[str, Any] = {"action": a.action, "sessionId": session_id}

    def elapsed() -> float:
        return round((time.perf_counter() - started) * 1000, 2)

    session: Session | None = None
    try:
        if a.action == "closeSession":
            closed = await manager.close_session(session_id)
            return {"ok": True, **head, "url": None, "title": None, "executionTime": elapsed(), "closed": closed}
        if a.action in ("navigate", "newPage") and a.url:
            check_url(ctx.policy, a.url)  # refuse before a browser is started for it
        if a.action == "evaluate":
            _allow_evaluate(ctx)
        session = await manager.session(session_id, headless, ctx.policy)
        async with session.lock:
            manager.touch(session)
            try:
                try:
                    async with asyncio.timeout(a.timeoutMs / 1000 + 2.0):
                        extra = await _perform(ctx, session, a)
                        await _check_where(ctx, session)
                except (PlaywrightError, TimeoutError) as exc:
                    raise ToolError(_playwright_message(exc, a, session)) from None
                where = await _where(session)
            finally:
                manager.touch(session)
        return {"ok": True, **head, **where, "executionTime": elapsed(), **extra}
    except ToolError as exc:
        message = str(exc) if str(exc).startswith(f"{a.action}:") else f"{a.action}: {exc}"
        exc.args = (message,)
        exc.result = {"ok": False, **head, **(await _where(session)), "executionTime": elapsed(),
                      "error": message, **(exc.result or {})}
        raise


def browser_toolset(manager: BrowserManager | None = None) -> ToolSet:
    """The `browser` tool set around its own `BrowserManager` (closed with the tool set).

    Raises `MissingDependency` naming what to install when Playwright or a system Chromium is missing.
    """
    mgr = manager or BrowserManager()

    @tool("browser.act", tool_type="action", timeout=MAX_TIMEOUT_S + mgr.launch_timeout + 30)
    async def act(ctx: ToolContext, action: Action, url: str | None = None, selector: str | None = None,
                  ref: str | None = None, text: str | None = None, value: str | None = None,
                  values: list[str] | None = None, key: str | None = None, attribute: str | None = None,
                  expression: str | None = None, x: float | None = None, y: float | None = None,
                  deltaY: float | None = None, path: str | None = None, fullPage: bool = False,
                  waitUntil: WaitUntil = "load", state: ElementState = "visible",
                  button: Literal["left", "right", "middle"] = "left",
                  clickCount: Annotated[int, Field(ge=1, le=3)] = 1,
                  delayMs: Annotated[int, Field(ge=0, le=1000)] = 0, sessionId: str = "default",
                  timeoutMs: TimeoutMs = 15000, headless: bool | None = None) -> dict[str, Any]:
        """Drive a Chromium tab: navigate, click, type, read, screenshot or snapshot a web page.

        Elements are named by `selector` (CSS or Playwright, e.g. "button:has-text('Sign in')") or by
        `ref` from the latest `snapshot`. `type`/`fill` text may hold {ENTER}, {TAB}, {ESC}, {BACKSPACE},
        {UP}, {DOWN}, {LEFT}, {RIGHT} and combos like {CMD+K} or {CTRL+A}. Each `sessionId` is its own
        tab with its own cookies, closed after a while unused; `timeoutMs` bounds every action. The result
        holds ok, action, sessionId, url, title, executionTime and the action's `value`.
        """
        args = Args(action=action, url=url, selector=selector, ref=ref, text=text, value=value, values=values,
                    key=key, attribute=attribute, expression=expression, x=x, y=y, deltaY=deltaY, path=path,
                    fullPage=fullPage, waitUntil=waitUntil, state=state, button=button, clickCount=clickCount,
                    delayMs=delayMs, timeoutMs=timeoutMs)
        return await run_action(mgr, ctx, args, sessionId, headless)

    return ToolSet("browser", [act], "Drive the system Chromium with Playwright (browser.act)", on_close=mgr.aclose)
