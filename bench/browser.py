"""Time per `browser.act` click on a local page, against the same click through raw Playwright.

    python -m bench.browser [N]

Anchor: Playwright driving the same system Chromium (same launch flags, its own browser process),
`page.click("#go")` on the same page. tether: `browser_toolset().call("browser.act", {"action": "click",
"selector": "#go"})` — validation, the session lookup, the policy checks, the click and the result's
url/title. Also on record: a click by snapshot `ref`. Rounds are interleaved so machine noise hits
both alike; the page is served by `http.server` on 127.0.0.1 from a thread.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench._stats import summary
from tether.protocol.models import ResultStatus
from tether.tools.browser.session import LAUNCH_ARGS, BrowserManager
from tether.tools.browser.tool import browser_toolset
from tether.tools.context import ToolContext
from tether.tools.policy.model import Policy

PAGE = b"""<!doctype html><title>Bench</title>
<button id="go" onclick="window.n = (window.n || 0) + 1; document.getElementById('out').textContent = window.n">
Press me</button><p id="out"></p>"""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def main(n: int) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    from playwright.async_api import async_playwright

    manager = BrowserManager()
    toolset = browser_toolset(manager)
    ctx = ToolContext(policy=Policy())
    async with async_playwright() as pw:
        root = os.geteuid() == 0
        browser = await pw.chromium.launch(executable_path=manager.executable, headless=True,
                                           args=[*LAUNCH_ARGS, *(["--no-sandbox"] if root else [])],
                                           chromium_sandbox=not root)
        context = await browser.new_context(viewport={"width": 1280, "height": 800})
        page = await context.new_page()
        await page.goto(url)

        async def call(**args: Any) -> dict[str, Any]:
            result = await toolset.call("browser.act", args, ctx)
            assert result.status is ResultStatus.SUCCESS, result.error
            return result.result

        await call(action="navigate", url=url, sessionId="bench")
        await call(action="navigate", url=url, sessionId="ref")
        snap = await call(action="snapshot", sessionId="ref")
        ref = next(line.split("[ref=")[1].split("]")[0] for line in snap["value"].splitlines() if "button" in line)

        raw, tether, by_ref = [], [], []
        for _ in range(max(3, n // 20)):  # warm-up
            await page.click("#go")
            await call(action="click", selector="#go", sessionId="bench")
            await call(action="click", ref=ref, sessionId="ref")
        for _ in range(n):
            t0 = time.perf_counter()
            await page.click("#go")
            raw.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await call(action="click", selector="#go", sessionId="bench")
            tether.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await call(action="click", ref=ref, sessionId="ref")
            by_ref.append(time.perf_counter() - t0)
        clicks = await call(action="getText", selector="#out", sessionId="bench")
        assert int(clicks["value"]) == n + max(3, n // 20)
        await browser.close()
    await toolset.aclose()
    server.shutdown()

    print(f"browser.act click on a local page (system Chromium {manager.executable}, headless), {n} clicks")
    base = summary("anchor: raw Playwright page.click('#go')", raw)
    row = summary("browser.act click selector='#go'", tether)
    ref_row = summary("browser.act click ref (from snapshot)", by_ref)
    print(f"ratio to anchor p50: selector {row['p50_us'] / base['p50_us']:.2f}x, ref "
          f"{ref_row['p50_us'] / base['p50_us']:.2f}x; overhead p50 {(row['p50_us'] - base['p50_us']) / 1000:.2f} ms")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
