"""browser.act against the system Chromium and a real HTTP server on 127.0.0.1.

Every call goes through `browser_toolset().call(...)`, i.e. argument validation, the runtime's deadline
and the `Result` an agent would see. A missing Playwright or Chromium fails these tests with the command
that installs it (never a skip).
"""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tether.protocol.models import Result, ResultStatus
from tether.tools.context import ToolContext
from tether.tools.errors import MissingDependency
from tether.tools.policy.model import Policy
from tether.tools.runtime import ToolSet

pytestmark = pytest.mark.asyncio(loop_scope="module")

FORM = """<!doctype html><html><head><title>Form page</title></head><body>
<h1 id="heading">Hello form</h1>
<form id="f" onsubmit="event.preventDefault(); document.getElementById('out').textContent =
  'submitted ' + document.getElementById('name').value + '/' + document.getElementById('email').value;">
  <label for="name">Name</label><input id="name" name="name">
  <label for="email">Email</label><input id="email" name="email">
  <label for="color">Color</label>
  <select id="color"><option value="r">Red</option><option value="g">Green</option><option value="b">Blue</option>
  </select>
  <label><input type="checkbox" id="agree"> I agree</label>
  <button type="submit" id="submit">Send</button>
</form>
<button id="go" onclick="window.clicks = (window.clicks || 0) + 1;
  document.getElementById('out2').textContent = 'button clicked ' + window.clicks">Press me</button>
<p id="out"></p><p id="out2"></p>
<a id="next" href="/page2" data-kind="nav">Next page</a>
<a id="popup" href="/page2" target="_blank">In a new tab</a>
<a id="away" href="http://localhost:{port}/page2">Away</a>
<div style="height: 3000px"></div><p id="bottom">Bottom</p>
</body></html>"""
PAGE2 = "<!doctype html><title>Second</title><p id='p2'>Second page</p>"
DELAYED = """<!doctype html><title>Delayed</title><body><script>
setTimeout(() => { const d = document.createElement('div'); d.id = 'late'; d.textContent = 'arrived late';
  document.body.appendChild(d); }, 300);</script></body>"""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/redirect-away":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/page2")
            self.end_headers()
            return
        body = {"/": FORM.replace("{port}", str(port)), "/page2": PAGE2, "/delayed": DELAYED}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _toolset(**manager_options: Any) -> tuple[ToolSet, Any]:
    """A browser tool set, or a test failure that says what to install."""
    try:
        from tether.tools.browser.session import BrowserManager
        from tether.tools.browser.tool import browser_toolset

        manager = BrowserManager(**manager_options)
    except (MissingDependency, ImportError) as exc:
        pytest.fail(f"browser tests need Playwright and Chromium: {exc}")
    return browser_toolset(manager), manager


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser() -> AsyncIterator[ToolSet]:
    toolset, _ = _toolset()
    yield toolset
    await toolset.aclose()


CTX = ToolContext(policy=Policy())


async def act(toolset: ToolSet, ctx: ToolContext = CTX, **args: Any) -> Result:
    return await toolset.call("browser.act", args, ctx)


async def ok(toolset: ToolSet, ctx: ToolContext = CTX, **args: Any) -> dict[str, Any]:
    result = await act(toolset, ctx, **args)
    assert result.status is ResultStatus.SUCCESS, result.error
    assert result.result["ok"] is True
    return result.result


def failed(result: Result) -> str:
    assert result.status is ResultStatus.FAILURE, result.result
    assert result.result is None or result.result.get("ok") in (False, None)
    return result.error or ""


async def test_form_fill_click_read_and_screenshot(browser: ToolSet, site: str, tmp_path: Path) -> None:
    sid = {"sessionId": "form"}
    r = await ok(browser, action="navigate", url=site + "/", **sid)
    assert r["status"] == 200 and r["url"] == site + "/" and r["title"] == "Form page"
    assert r["action"] == "navigate" and r["sessionId"] == "form" and r["executionTime"] > 0

    await ok(browser, action="fill", selector="#name", text="Ada{TAB}ada@example.com", **sid)
    assert (await ok(browser, action="select", selector="#color", value="g", **sid))["value"] == ["g"]
    assert (await ok(browser, action="check", selector="#agree", **sid))["value"] is True
    assert (await ok(browser, action="uncheck", selector="#agree", **sid))["value"] is False
    await ok(browser, action="press", selector="#email", key="{ENTER}", **sid)  # submits the form
    assert (await ok(browser, action="getText", selector="#out", **sid))["value"] == "submitted Ada/ada@example.com"

    await ok(browser, action="fill", selector="#name", text="Grace{ENTER}", **sid)
    assert (await ok(browser, action="getText", selector="#out", **sid))["value"] == "submitted Grace/ada@example.com"
    await ok(browser, action="type", selector="#name", text=" Hopper{BACKSPACE}r", **sid)
    assert (await ok(browser, action="getAttribute", selector="#next", attribute="data-kind", **sid))["value"] == "nav"

    await ok(browser, action="click", selector="#go", **sid)
    await ok(browser, action="hover", selector="#go", **sid)
    assert (await ok(browser, action="getText", selector="#out2", **sid))["value"] == "button clicked 1"
    text = (await ok(browser, action="getPageText", **sid))["value"]
    assert "Hello form" in text and "button clicked 1" in text and "submitted Grace" in text
    assert (await ok(browser, action="getUrl", **sid))["value"] == site + "/"

    scrolled = await ok(browser, action="scroll", deltaY=500, **sid)
    assert scrolled["scrollY"] == 500
    assert (await ok(browser, action="scroll", selector="#bottom", **sid))["scrollY"] > 500

    shot = await ok(browser, action="screenshot", path=str(tmp_path / "shots" / "page.png"), **sid)
    png = Path(shot["path"]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) == shot["bytes"] > 1000
    assert (shot["width"], shot["height"]) == (1280, 800) and "base64" not in shot
    inline = await ok(browser, action="screenshot", fullPage=True, **sid)
    data = base64.b64decode(inline["base64"])
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and inline["height"] > 3000
    element = await ok(browser, action="screenshot", selector="#go", **sid)
    assert 0 < element["width"] < 400


async def test_screenshot_path_is_jailed(browser: ToolSet, site: str, tmp_path: Path) -> None:
    ctx = ToolContext(policy=Policy(write_roots=[str(tmp_path)]))
    result = await act(browser, ctx, action="screenshot", path="/etc/tether-shot.png", sessionId="jail")
    assert "write_roots" in failed(result) and result.result["rule"] == "write_roots"


async def test_history_links_and_navigation_waits(browser: ToolSet, site: str) -> None:
    sid = {"sessionId": "history"}
    await ok(browser, action="navigate", url=site + "/", **sid)
    await ok(browser, action="click", selector="#next", **sid)
    r = await ok(browser, action="waitForNavigation", url="/page2", **sid)
    assert r["url"] == site + "/page2" and r["title"] == "Second"
    assert (await ok(browser, action="back", **sid))["url"] == site + "/"
    assert (await ok(browser, action="forward", **sid))["url"] == site + "/page2"
    r = await ok(browser, action="reload", **sid)
    assert r["status"] == 200 and r["title"] == "Second"
    await ok(browser, action="waitForNavigation", **sid)  # already loaded: returns at once
    await ok(browser, action="navigate", url=site + "/", **sid)
    await ok(browser, action="click", selector="#popup", **sid)  # the new tab becomes the session's one tab
    r = await ok(browser, action="waitForNavigation", url="/page2", **sid)
    assert r["title"] == "Second" and (await ok(browser, action="back", **sid))["moved"] is False
    r = await ok(browser, action="newPage", url=site + "/delayed", **sid)
    assert r["title"] == "Delayed"
    assert (await ok(browser, action="back", **sid))["moved"] is False  # a fresh tab has no history


async def test_snapshot_refs_click_type_and_go_stale(browser: ToolSet, site: str) -> None:
    sid = {"sessionId": "snap"}
    await ok(browser, action="navigate", url=site + "/", **sid)
    snap = await ok(browser, action="snapshot", **sid)
    tree = snap["value"]
    assert 'heading "Hello form"' in tree and snap["refs"] > 5
    button = re.search(r'button "Press me" \[ref=(e\d+)\]', tree).group(1)
    name = re.search(r'textbox "Name" \[ref=(e\d+)\]', tree).group(1)
    await ok(browser, action="click", ref=button, **sid)
    await ok(browser, action="click", ref=button, **sid)
    assert (await ok(browser, action="getText", selector="#out2", **sid))["value"] == "button clicked 2"
    await ok(browser, action="type", ref=name, text="Lin", **sid)
    await ok(browser, action="fill", selector="#email", text="lin@example.com", **sid)
    await ok(browser, action="press", ref=name, key="Enter", **sid)
    assert "unknown" in failed(await act(browser, action="click", ref="e999999", **sid))
    assert "not a snapshot reference" in failed(await act(browser, action="click", ref="#go", **sid))
    assert (await ok(browser, action="getText", selector="#out", **sid))["value"] == "submitted Lin/lin@example.com"

    await ok(browser, action="navigate", url=site + "/page2", **sid)
    error = failed(await act(browser, action="click", ref=button, **sid))
    assert "stale" in error and "snapshot" in error
    assert "takes no selector" in failed(await act(browser, action="snapshot", selector="#p2", **sid))


async def test_wait_for_selector_and_timeouts(browser: ToolSet, site: str) -> None:
    sid = {"sessionId": "wait"}
    await ok(browser, action="navigate", url=site + "/delayed", **sid)
    await ok(browser, action="waitForSelector", selector="#late", **sid)
    assert (await ok(browser, action="getText", selector="#late", **sid))["value"] == "arrived late"
    result = await act(browser, action="waitForSelector", selector="#never", timeoutMs=300, **sid)
    error = failed(result)
    assert "waitForSelector: timed out after 300 ms waiting for '#never'" in error
    assert result.result["url"] == site + "/delayed" and result.result["title"] == "Delayed"
    assert "timed out after 250 ms" in failed(await act(browser, action="click", selector="#nope", timeoutMs=250,
                                                        **sid))
    assert "needs 'selector' or 'ref'" in failed(await act(browser, action="click", **sid))
    assert "needs 'key'" in failed(await act(browser, action="press", **sid))


async def test_evaluate_only_when_the_policy_allows(browser: ToolSet, site: str) -> None:
    result = await act(browser, action="evaluate", expression="1 + 1", sessionId="eval")
    assert "browser.evaluate" in failed(result) and result.result["rule"] == "browser.evaluate"
    allowed = ToolContext(policy=Policy(browser_allow_evaluate=True))
    await ok(browser, allowed, action="navigate", url=site + "/", sessionId="eval")
    r = await ok(browser, allowed, action="evaluate", expression="document.title + ' ' + (6 * 7)", sessionId="eval")
    assert r["value"] == "Form page 42"


@pytest.mark.parametrize("url", ["file:///etc/passwd", "javascript:alert(1)", " JavaScript:alert(1)",
                                 "data:text/html,<h1>x</h1>", "chrome://settings", "about:config",
                                 "view-source:http://127.0.0.1/"])
async def test_refused_url_schemes(url: str) -> None:
    toolset, manager = _toolset()
    result = await act(toolset, action="navigate", url=url)
    error = failed(result)
    assert "denied by policy rule 'browser.scheme'" in error and result.result["rule"] == "browser.scheme"
    assert result.result["action"] == "navigate" and result.result["sessionId"] == "default"
    assert not manager.running  # refused before a browser was started for it
    assert result.result["rule"] == "browser.scheme"
    await toolset.aclose()


async def test_url_tricks_and_allowed_schemes(browser: ToolSet) -> None:
    assert "browser.url" in failed(await act(browser, action="navigate", url="java\tscript:alert(1)"))
    assert "not an absolute URL" in failed(await act(browser, action="navigate", url="example.com"))
    with_data = ToolContext(policy=Policy(browser_allowed_schemes=["http", "https", "data"]))
    r = await ok(browser, with_data, action="navigate", url="data:text/html,<title>D</title>", sessionId="data")
    assert r["title"] == "D"


async def test_origin_allowlist(browser: ToolSet, site: str) -> None:
    port = site.rsplit(":", 1)[1]
    ctx = ToolContext(policy=Policy(browser_allowed_origins=[site]))
    sid = {"sessionId": "origins"}
    result = await act(browser, ctx, action="navigate", url=f"http://localhost:{port}/page2", **sid)
    assert "browser.origin" in failed(result) and result.result["rule"] == "browser.origin"
    await ok(browser, ctx, action="navigate", url=site + "/", **sid)
    # a link the page follows by itself is stopped too, and the tab does not end up there
    result = await act(browser, ctx, action="click", selector="#away", **sid)
    assert "browser.origin" in failed(result) and f"localhost:{port}" in result.error
    assert not (await ok(browser, ctx, action="getUrl", **sid))["value"].startswith("http://localhost")
    result = await act(browser, ctx, action="navigate", url=site + "/redirect-away", **sid)
    assert "browser.origin" in failed(result)
    assert (await ok(browser, ctx, action="getUrl", **sid))["value"] in ("about:blank", "chrome-error://chromewebdata/")
    wildcard = ToolContext(policy=Policy(browser_allowed_origins=["http://*.example.test", "127.0.0.1"]))
    await ok(browser, wildcard, action="navigate", url=site + "/page2", sessionId="origins-wild")


async def test_argument_validation(browser: ToolSet) -> None:
    error = failed(await act(browser, action="teleport"))
    assert "argument 'action'" in error
    assert "unknown argument 'bogus'" in failed(await act(browser, action="getUrl", bogus=1))
    assert "argument 'timeoutMs'" in failed(await act(browser, action="getUrl", timeoutMs=0))
    assert "unknown key token {ENTR}" in failed(await act(browser, action="type", text="x{ENTR}", sessionId="v"))


async def test_headed_mode_needs_a_display(browser: ToolSet, monkeypatch: pytest.MonkeyPatch) -> None:
    await ok(browser, action="getUrl", sessionId="mode")
    assert "close it (closeSession)" in failed(await act(browser, action="getUrl", sessionId="mode", headless=False))
    monkeypatch.delenv("DISPLAY", raising=False)
    assert "$DISPLAY is not set" in failed(await act(browser, action="getUrl", sessionId="headed", headless=False))


async def test_close_session_then_reopen(browser: ToolSet, site: str) -> None:
    sid = {"sessionId": "closing"}
    await ok(browser, action="navigate", url=site + "/page2", **sid)
    r = await ok(browser, action="closeSession", **sid)
    assert r["closed"] is True and r["url"] is None
    assert (await ok(browser, action="closeSession", **sid))["closed"] is False
    assert (await ok(browser, action="getUrl", **sid))["value"] == "about:blank"
    await ok(browser, action="navigate", url=site + "/", **sid)
    assert (await ok(browser, action="getText", selector="#heading", **sid))["value"] == "Hello form"


async def test_idle_sessions_are_closed(site: str) -> None:
    toolset, manager = _toolset(idle_timeout=0.3)
    closed: asyncio.Queue[str] = asyncio.Queue()
    manager.on_idle_close = closed.put_nowait
    try:
        await ok(toolset, action="navigate", url=site + "/", sessionId="idle")
        await ok(toolset, action="navigate", url=site + "/page2", sessionId="busy")
        assert {await asyncio.wait_for(closed.get(), 10), await asyncio.wait_for(closed.get(), 10)} == {"idle", "busy"}
        assert not manager.sessions
        assert (await ok(toolset, action="getUrl", sessionId="idle"))["value"] == "about:blank"
    finally:
        await toolset.aclose()
    assert not manager.running


async def test_toolset_close_stops_chromium(site: str) -> None:
    toolset, manager = _toolset()
    await ok(toolset, action="navigate", url=site + "/page2")
    assert manager.running
    await toolset.aclose()
    await toolset.aclose()
    assert not manager.running
    assert "closed" in failed(await act(toolset, action="getUrl"))


async def test_missing_chromium_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tether.tools.browser.session import BrowserManager

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("TETHER_CHROMIUM", raising=False)
    with pytest.raises(MissingDependency) as caught:
        BrowserManager()
    assert "apt-get install chromium" in str(caught.value) and "pip install 'tether[browser]'" in str(caught.value)
    monkeypatch.setenv("TETHER_CHROMIUM", str(tmp_path / "nope"))
    with pytest.raises(MissingDependency, match="TETHER_CHROMIUM"):
        BrowserManager()


async def test_key_tokens() -> None:
    from tether.tools.browser.keys import key_name, split_keys

    assert split_keys("Hello world{ENTER}") == [(False, "Hello world"), (True, "Enter")]
    assert split_keys("{CMD+K}x{CTRL+SHIFT+TAB}") == [(True, "Meta+k"), (False, "x"), (True, "Control+Shift+Tab")]
    assert split_keys('{"a": {x}}') == [(False, '{"a": {x}}')]
    assert [k for _, k in split_keys("{ESC}{BACKSPACE}{UP}{DOWN}{LEFT}{RIGHT}")] == [
        "Escape", "Backspace", "ArrowUp", "ArrowDown", "ArrowLeft", "ArrowRight"]
    assert key_name("{ENTER}") == "Enter" and key_name("CMD+C") == "Meta+c" and key_name("Control+a") == "Control+a"
    assert key_name("A") == "A" and key_name("PageDown") == "PageDown" and key_name("{F5}") == "F5"
