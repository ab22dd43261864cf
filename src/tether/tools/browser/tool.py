"""`browser.act`: seed 004's browser skill, Playwright driving the system Chromium.

One tool with an `action` argument, as the seed's payloads have it (`{"action": "navigate", "url": ...,
"sessionId": ...}`), so a planner learns one schema. Every action runs under `timeoutMs` and answers with
`ok, action, sessionId, url, title, executionTime` plus its value (`value` for anything read; a
screenshot's `base64` or `path`); a failure carries the same fields and `error`, so recovery sees where the
tab was. Elements are named by a CSS/Playwright `selector` or by a `ref` from the latest `snapshot` (the
page's ARIA tree); refs die with the document, and a stale one fails with that reason instead of
clicking something else. URLs go through the policy (`browser_allowed_schemes`, `browser_allowed_origins`),
and `evaluate` runs only when `browser_allow_evaluate` is set: the agent's JavaScript can do anything
the page can. The actions themselves are in `tether.tools.browser.actions`; this module wraps each call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from pydantic import Field

from tether.tools.browser.actions import (
    ACTIONS,
    REPEATABLE,
    Args,
    ElementState,
    WaitUntil,
    allow_evaluate,
)
from tether.tools.browser.session import NEUTRAL_URLS, BrowserManager, Session
from tether.tools.browser.urls import check_url
from tether.tools.context import ToolContext
from tether.tools.errors import PolicyDenied, ToolError
from tether.tools.runtime import ToolSet, tool

Action = Literal["navigate", "back", "forward", "reload", "click", "hover", "type", "fill", "press", "select",
                 "check", "uncheck", "scroll", "waitForSelector", "waitForNavigation", "getText", "getPageText",
                 "getAttribute", "getUrl", "evaluate", "screenshot", "snapshot", "newPage", "closeSession"]
TimeoutMs = Annotated[int, Field(ge=1, le=300_000)]
MAX_TIMEOUT_S = 300.0


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
            allow_evaluate(ctx)
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
