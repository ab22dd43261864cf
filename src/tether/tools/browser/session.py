"""Browser sessions for `browser.act`: one system Chromium per manager, one context and tab per sessionId.

State lives in a `BrowserManager` that the tool set creates and closes (never module state), so two
devices in one process never share a browser and a test can give its manager a tiny idle timeout.
Chromium starts lazily on the first call, always the system binary (`executable_path`): Playwright's
own browser downloads are never used. Idle sessions are closed by a reaper task, and when none are
left the browser itself is shut down after another idle period, so a device left alone holds no
Chromium. URLs are judged by `check_url` before they are opened and again where Chromium ended up
(redirects, links), because a page can navigate by itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.tools.browser.urls import check_url, needs_route
from tether.tools.errors import MissingDependency, ToolError, require
from tether.tools.policy.model import Policy

if TYPE_CHECKING:
    from playwright.async_api import Browser, BrowserContext, Page, Playwright, Request, Route

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tether[browser]' (Playwright) and apt-get install chromium (the browser it drives)"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
LAUNCH_ARGS = ("--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync")
NEUTRAL_URLS = ("about:blank", "chrome-error://chromewebdata/")  # where a fresh or blocked tab sits
REF_PATTERN = re.compile(r"(?:f\d+)?e\d+")
_SNAPSHOT_REF = re.compile(r"\[ref=((?:f\d+)?e\d+)\]")


def find_chromium() -> str:
    """The system Chromium: `$TETHER_CHROMIUM`, else chromium, chromium-browser or google-chrome on PATH."""
    env = os.environ.get("TETHER_CHROMIUM")
    if env:
        found = shutil.which(env)
        if found is None:
            raise MissingDependency(f"$TETHER_CHROMIUM={env!r} is not an executable program; unset it or point it "
                                    "at a Chromium binary")
        return found
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise MissingDependency(f"the browser tools need a system Chromium ({', '.join(CHROMIUM_NAMES)} on PATH or "
                            f"$TETHER_CHROMIUM): apt-get install chromium; and Playwright: pip install "
                            "'tether[browser]'")


# ---------------------------------------------------------------- sessions


@dataclass(eq=False)
class Session:
    """One sessionId: its own context (cookies, storage) and exactly one tab."""

    id: str
    headless: bool
    context: BrowserContext
    page: Page
    policy: Policy
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    refs: set[str] = field(default_factory=set)
    document: int = 0  # bumped on every new document in the tab
    snapshot_document: int = -1  # the document the refs belong to
    routed: bool = False
    blocked: list[tuple[str, str, str]] = field(default_factory=list)  # (rule, url, reason) of refused navigations
    owner: BrowserManager | None = None


class BrowserManager:
    """The Playwright driver, up to two Chromium processes (headless, headed) and the sessions on them."""

    def __init__(self, *, idle_timeout: float = 600.0, max_sessions: int = 16, launch_timeout: float = 30.0,
                 executable: str | None = None) -> None:
        require("playwright", f"the browser tools need Playwright: {INSTALL_HINT}")
        self.executable = executable or find_chromium()
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self.launch_timeout = launch_timeout
        self.sessions: dict[str, Session] = {}
        self.on_idle_close: Any = None  # optional callable(session_id): tests wait on it instead of sleeping
        self._playwright: Playwright | None = None
        self._browsers: dict[bool, Browser] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def default_headless(self) -> bool:
        """Headless unless TETHER_BROWSER_HEADLESS=0 and a display is set: predictable by default."""
        return not (os.environ.get("TETHER_BROWSER_HEADLESS", "1") == "0" and os.environ.get("DISPLAY"))

    async def session(self, session_id: str, headless: bool | None, policy: Policy) -> Session:
        """The live session `session_id`, created (and Chromium launched) on first use."""
        if self._closed:
            raise ToolError("the browser tool set is closed")
        async with self._lock:
            session = self.sessions.get(session_id)
            if session is not None and (not session.context.browser or not session.context.browser.is_connected()):
                self.sessions.pop(session_id, None)
                session = None
            if session is not None:
                if headless is not None and headless != session.headless:
                    raise ToolError(f"session {session_id!r} is {'headless' if session.headless else 'headed'}; "
                                    "close it (closeSession) before asking for the other mode")
            else:
                if len(self.sessions) >= self.max_sessions:
                    raise ToolError(f"too many browser sessions ({self.max_sessions}); close one with closeSession")
                mode = self.default_headless() if headless is None else headless
                browser = await self._browser(mode)
                context = await browser.new_context(accept_downloads=False, service_workers="block",
                                                    viewport={"width": 1280, "height": 800})
                page = await context.new_page()
                session = Session(session_id, mode, context, page, policy, owner=self)
                self._watch(session, page)
                context.on("page", functools.partial(self.adopt, session))
                self.sessions[session_id] = session
                self._start_reaper()
            session.policy = policy
            if needs_route(policy) and not session.routed:
                await session.context.route("**/*", lambda route, request, s=session: self._route(s, route, request))
                session.routed = True
            if session.page.is_closed():  # the page closed itself (window.close())
                self.adopt(session, await session.context.new_page())
            return session

    def touch(self, session: Session) -> None:
        session.last_used = time.monotonic()
        self._wake.set()

    def adopt(self, session: Session, page: Page) -> None:
        """Make `page` the session's one tab (a popup, or newPage) and close the previous one."""
        if page is session.page:
            return
        old, session.page = session.page, page
        session.refs.clear()
        session.document += 1
        self._watch(session, page)
        if not old.is_closed():
            self._spawn(old.close())

    def _watch(self, session: Session, page: Page) -> None:
        def new_document(_: Any) -> None:
            if page is session.page:
                session.document += 1

        page.on("domcontentloaded", new_document)

    async def _route(self, session: Session, route: Route, request: Request) -> None:
        """Refuse navigations (top-level and frames) the policy does not allow; let everything else pass."""
        if request.is_navigation_request():
            try:
                check_url(session.policy, request.url)
            except ToolError as exc:
                rule = getattr(exc, "rule", "browser.url")
                reason = str(exc).removeprefix(f"denied by policy rule '{rule}': ")
                logger.warning("browser session %s: blocked navigation to %s: %s", session.id, request.url, exc)
                session.blocked.append((rule, request.url, reason))
                await route.abort("blockedbyclient")
                return
        await route.fallback()

    async def _browser(self, headless: bool) -> Browser:
        browser = self._browsers.get(headless)
        if browser is not None and browser.is_connected():
            return browser
        if not headless and not os.environ.get("DISPLAY"):
            raise ToolError("headless=false needs a display, and $DISPLAY is not set (start Xvfb or use headless)")
        if self._playwright is None:
            from playwright.async_api import async_playwright

            self._playwright = await async_playwright().start()
        args = list(LAUNCH_ARGS)
        root = hasattr(os, "geteuid") and os.geteuid() == 0
        if root:
            args.append("--no-sandbox")  # Chromium refuses to run its sandbox as root
        try:
            browser = await self._playwright.chromium.launch(
                executable_path=self.executable, headless=headless, args=args, chromium_sandbox=not root,
                timeout=self.launch_timeout * 1000)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ToolError(f"could not start Chromium ({self.executable}): {first}") from exc
        browser.on("disconnected", lambda b: self._forget(b))
        self._browsers[headless] = browser
        return browser

    def _forget(self, browser: Browser) -> None:
        """Chromium exited or crashed: drop what ran on it; the next call starts a fresh one."""
        for mode, known in list(self._browsers.items()):
            if known is browser:
                del self._browsers[mode]
        for sid, session in list(self.sessions.items()):
            if session.context.browser is browser:
                del self.sessions[sid]

    async def close_session(self, session_id: str) -> bool:
        """Close the session's context (and tab); whether there was one."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        self._wake.set()
        try:
            await session.context.close()
        except Exception as exc:  # the browser may already be gone
            logger.debug("closing browser session %s: %s", session_id, exc)
        return True

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="tether-browser-reaper")

    async def _reap(self) -> None:
        """Close sessions idle for `idle_timeout`; when none remain for as long, shut Chromium down.

        A session with a call in flight is never closed; calls `touch` it at their start and end.
        """
        empty_since: float | None = None
        while not self._closed:
            now = time.monotonic()
            idle = [s for s in self.sessions.values() if not s.lock.locked()]
            expired = [s for s in idle if now - s.last_used >= self.idle_timeout]
            for session in expired:
                logger.info("closing idle browser session %s", session.id)
                await self.close_session(session.id)
                if self.on_idle_close is not None:
                    self.on_idle_close(session.id)
            if expired:
                continue
            if self.sessions:
                empty_since = None
                due = min((s.last_used for s in idle), default=now) + self.idle_timeout
            else:
                empty_since = empty_since or now
                if now - empty_since >= self.idle_timeout:
                    async with self._lock:
                        if not self.sessions:
                            await self._close_browsers()
                            return
                    continue
                due = empty_since + self.idle_timeout
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.01, due - time.monotonic()))
            except TimeoutError:
                pass

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_browsers(self) -> None:
        for browser in list(self._browsers.values()):
            try:
                await browser.close()
            except Exception as exc:
                logger.debug("closing Chromium: %s", exc)
        self._browsers.clear()
        if self._playwright is not None:
            playwright, self._playwright = self._playwright, None
            try:
                await playwright.stop()
            except Exception as exc:
                logger.debug("stopping Playwright: %s", exc)

    @property
    def running(self) -> bool:
        """Whether a Chromium process is up (for tests and the device profile)."""
        return any(b.is_connected() for b in self._browsers.values())

    async def aclose(self) -> None:
        """Close every session, Chromium and the Playwright driver; safe to call twice."""
        self._closed = True
        self._wake.set()
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper is not asyncio.current_task():
            reaper.cancel()
            await asyncio.gather(reaper, return_exceptions=True)
        for sid in list(self.sessions):
            await self.close_session(sid)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._close_browsers()


def snapshot_refs(text: str) -> set[str]:
    """The refs (`e12`, `f1e3`) an ARIA snapshot hands out."""
    return set(_SNAPSHOT_REF.findall(text))
