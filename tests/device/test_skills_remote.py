"""The GUI skills through a device connected to a real server: commands cross the WebSocket."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.kits.desktop import GUI_APP, TITLE, EventLog, GuiApp, require_programs, running_xvfb, stop
from tests.kits.netutil import Cluster
from tether.protocol.models import Command, ResultStatus

PAGE = b"""<!doctype html><title>Remote page</title>
<label>Name <input id="name"></label><button id="go">Go</button><p id="out"></p>
<script>
document.getElementById("go").onclick = () => {
  document.getElementById("out").textContent = "hi " + document.getElementById("name").value;
};
</script>"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def page_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def display(tmp_path_factory):
    require_programs()
    with running_xvfb(tmp_path_factory.mktemp("xvfb-remote") / "xvfb.log") as number:
        yield number


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def test_browser_act_over_the_websocket(cluster, page_url):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    assert "browser" in cluster.remote.device("alpha")["capabilities"]
    act = [
        Command(tool_name="browser.act", parameters={"action": "navigate", "url": page_url, "sessionId": "r"}),
        Command(tool_name="browser.act", parameters={"action": "fill", "selector": "#name", "text": "tether",
                                                     "sessionId": "r"}),
        Command(tool_name="browser.act", parameters={"action": "click", "selector": "#go", "sessionId": "r"}),
        Command(tool_name="browser.act", parameters={"action": "getText", "selector": "#out", "sessionId": "r"}),
        Command(tool_name="browser.act", parameters={"action": "navigate", "url": "file:///etc/passwd",
                                                     "sessionId": "r"}),
    ]
    _, results = cluster.remote.run("alpha", act, timeout=120, early_exit=False)
    assert [r.status for r in results[:4]] == [ResultStatus.SUCCESS] * 4, [r.error for r in results]
    assert results[0].result["title"] == "Remote page"
    assert results[3].result["value"] == "hi tether"
    assert results[4].status is ResultStatus.FAILURE and "browser.scheme" in results[4].error


def test_desktop_skills_over_the_websocket(cluster, display, tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    proc = subprocess.Popen([sys.executable, str(GUI_APP), str(log)], env={**os.environ, "DISPLAY": display})
    app = GuiApp(proc, log)
    try:
        asyncio.run(app.wait_event("ready"))
        alpha = cluster.device("alpha", env={"DISPLAY": display})
        cluster.wait_online("alpha", alpha, timeout=120)
        assert "desktop" in cluster.remote.device("alpha")["capabilities"]
        _, [clicked] = cluster.remote.run("alpha", [Command(tool_name="ui.findAndClick", parameters={
            "label": "Submit", "app": TITLE, "timeoutMs": 20000})], timeout=120)
        assert clicked.ok, clicked.error
        asyncio.run(app.wait_event("submit"))
        _, [seen] = cluster.remote.run("alpha", [Command(tool_name="ui.waitFor", parameters={
            "condition": "titleIncludes", "value": "Tether", "timeoutMs": 10000})], timeout=60)
        assert seen.ok, seen.error
    finally:
        asyncio.run(stop(proc, display, TITLE))
