"""The dashboard in the system Chromium (Playwright) against a real `tether server` and real `tether
device` processes: log in, watch devices live, run a tool, follow a task to its question and answer
it, cancel one, scopes and CSRF. Every main view is saved as a screenshot (artifacts), and any
JavaScript error or console error on the dashboard fails the test."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits.netutil import Cluster, TcpProxy, free_port
from tether.protocol.models import Command
from tether.tools.browser.session import find_chromium

ARTIFACTS = Path(os.environ.get("TETHER_TEST_ARTIFACTS", Path(__file__).parent / "artifacts"))
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("dash"))
    alpha = c.device("alpha")
    c.wait_online("alpha", alpha)
    yield c
    c.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)  # an upper bound for failure; expectations end on the event
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=find_chromium(), args=["--no-sandbox"])
        yield chromium
        chromium.close()


class Dash:
    """One browser context logged in with a token; console errors collected for the end of the test."""

    def __init__(self, browser: object, cluster: Cluster, token: str) -> None:
        self.base = f"http://127.0.0.1:{cluster.port}"
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})  # type: ignore[attr-defined]
        self.context.set_default_timeout(WAIT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.expected_errors: list[str] = []  # console lines a test provokes on purpose (an HTTP error shown)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(self.base + "/")
        self.page.get_by_label("API token").fill(token)
        self.page.get_by_role("button", name="Log in").click()
        self.page.get_by_role("heading", name="Devices").wait_for()

    def shot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)

    def csrf(self) -> str:
        return self.context.request.get(self.base + "/web/session").json()["csrf"]

    def close(self) -> None:
        self.context.close()
        errors = [e for e in self.errors if not any(x in e for x in self.expected_errors)]
        assert not errors, f"JavaScript errors on the dashboard: {errors}"


@pytest.fixture
def admin(browser: object, cluster: Cluster) -> Iterator[Dash]:
    dash = Dash(browser, cluster, cluster.api_token)
    yield dash
    dash.close()


def row(dash: Dash, device: str) -> Any:
    return dash.page.locator(f'tr[data-device="{device}"]')


def test_login_shows_devices_live_and_offline_when_killed(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    expect(row(admin, "alpha")).to_contain_text("online")
    beta = cluster.device("beta")  # appears without a reload, from the fleet stream
    expect(row(admin, "beta")).to_contain_text("online")
    admin.shot("devices")
    beta.kill()
    expect(row(admin, "beta")).to_contain_text("offline")


def test_run_a_tool_from_its_schema_and_watch_the_output(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    admin.page.get_by_role("link", name="alpha").click()
    admin.page.get_by_label("Tool").select_option("shell.run")
    admin.page.locator("#arg-cmd").fill("echo")
    admin.page.locator("#arg-argv").fill(json.dumps(["streamed-hello"]))
    admin.page.locator("#arg-cwd").fill(str(cluster.tmp))
    admin.page.get_by_role("button", name="Run").click()
    output = admin.page.locator("#tool-output")
    expect(output).to_contain_text("streamed-hello")
    expect(output).to_contain_text("[success]")
    expect(admin.page.get_by_text("Full profile")).to_be_visible()
    admin.shot("device")


@contextmanager
def threaded_proxy(port: int) -> Iterator[tuple[int, Callable[[], None]]]:
    """netutil's TcpProxy on its own loop in a thread (these tests drive Playwright synchronously)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = asyncio.run_coroutine_threadsafe(TcpProxy(port).start(), loop).result(WAIT_MS / 1000)
    try:
        yield proxy.port, lambda: loop.call_soon_threadsafe(proxy.cut)
    finally:
        asyncio.run_coroutine_threadsafe(proxy.aclose(), loop).result(WAIT_MS / 1000)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_MS / 1000)
        loop.close()


def start_plan(dash: Dash, plan: str, device: str = "alpha") -> None:
    """Start a plan from the tasks page: on `device`, or ("") on any device that meets the requirements."""
    dash.page.get_by_role("link", name="Tasks").click()
    dash.page.get_by_label("…or a plan").fill(plan)
    dash.page.get_by_label("Device", exact=True).select_option(device)
    dash.page.get_by_role("button", name="Start").click()
    dash.page.locator("#question, [data-step]").first.wait_for()


def test_task_steps_arrive_its_question_is_answered_and_it_finishes(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    plan = (f"- skill: shell.run\n  args: {{cmd: echo, argv: [first-step-ran], cwd: '{cluster.tmp}'}}\n"
            f"- skill: shell.run\n  args: {{cmd: ls, argv: ['{cluster.tmp}/no-such-file'], cwd: '{cluster.tmp}'}}\n")
    start_plan(admin, plan)
    events = admin.page.get_by_role("list", name="events")
    expect(events).to_contain_text("first-step-ran")
    question = admin.page.locator("#question")
    expect(question).to_contain_text("failed")
    expect(admin.page.locator("#badge")).to_have_text("1")
    admin.shot("task-question")
    # a second view of the task, through a proxy that drops its stream: it reconnects and resumes
    # after the last event it saw, so at the end every event is there once, in order
    task_id = admin.page.url.rsplit("/", 1)[1]
    with threaded_proxy(cluster.port) as (proxy, cut):
        other = admin.context.new_page()
        other_errors: list[str] = []
        other.on("pageerror", lambda e: other_errors.append(str(e)))
        other.goto(f"http://127.0.0.1:{proxy}/#/tasks/{task_id}")
        other_events = other.get_by_role("list", name="events")
        expect(other_events).to_have_attribute("data-connects", "1")
        expect(other_events).to_contain_text("question")
        cut()  # the task goes on while that view is cut off: the events it misses come on its reconnect
        question.get_by_role("button", name="skip this step").click()
        expect(other_events).to_have_attribute("data-connects", "2")
        expect(admin.page.locator("h1 .status")).to_have_text("done")
        expect(events).to_contain_text("finished")
        seqs = [int(s) for s in admin.page.locator("ul.events li").evaluate_all("els => els.map(e => e.dataset.seq)")]
        assert seqs == list(range(len(seqs))), seqs
        expect(other.locator("h1 .status")).to_have_text("done")
        expect(other.locator("ul.events li")).to_have_count(len(seqs))
        resumed = [int(s) for s in other.locator("ul.events li").evaluate_all("els => els.map(e => e.dataset.seq)")]
        assert resumed == seqs and not other_errors, (resumed, other_errors)
        other.close()
    expect(admin.page.locator("#question")).to_have_count(0)
    admin.shot("task-done")
    admin.page.get_by_role("link", name="Tasks").click()
    admin.page.get_by_label("State").select_option("done")
    expect(admin.page.get_by_role("table", name="tasks")).to_contain_text("done")
    admin.shot("tasks")


def test_an_approval_shows_what_would_change_and_approving_finishes_it(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    doomed = cluster.tmp / "doomed"
    doomed.mkdir()
    (doomed / "notes.txt").write_text("x")
    made = httpx.post(f"{admin.base}/api/v1/devices/alpha/policy/approve", json={"program": "rm"}, timeout=30,
                      headers={"Authorization": f"Bearer {cluster.api_token}"})  # rm needs a person's yes now
    assert made.status_code == 200, made.text
    start_plan(admin, f"- skill: shell.run\n  args: {{cmd: rm, argv: ['-r', '{doomed}'], cwd: '{cluster.tmp}'}}\n")
    question = admin.page.locator("#question")
    expect(question).to_contain_text("Approval needed")
    expect(question).to_contain_text("rm")
    expect(admin.page.locator("#badge")).to_have_text("1")  # the badge follows the task's events
    admin.shot("task-approval")
    assert doomed.exists()  # nothing happened before the approval
    question.get_by_role("button", name="approve").click()
    expect(admin.page.locator("h1 .status")).to_have_text("done")
    assert not doomed.exists()


def test_the_badge_is_pushed_when_something_waits_elsewhere_and_when_it_is_answered(admin: Dash,
                                                                                   cluster: Cluster) -> None:
    """The badge follows GET /api/v1/approvals/events: a task started elsewhere (REST, another person) that waits
    for a confirmation shows at once on a page that opened no task, and goes when it is approved elsewhere; the
    page asks nothing in between (no polling)."""
    from playwright.sync_api import expect

    asked: list[str] = []
    admin.page.on("request", lambda r: asked.append(r.url))
    api = f"{admin.base}/api/v1"
    person = {"Authorization": f"Bearer {cluster.api_token}"}
    expect(admin.page.locator("#badge")).to_be_hidden()
    before = len(asked)
    plan = [{"skill": "write_file", "args": {"file_path": str(cluster.tmp / "badge.txt"), "content": "x"}}]
    task = httpx.post(f"{api}/tasks", headers=person, timeout=30,
                      json={"device": "alpha", "confirm": "always", "plan": plan})
    assert task.status_code == 201, task.text
    expect(admin.page.locator("#badge")).to_have_text("1", timeout=3000)
    approved = httpx.post(f"{api}/tasks/{task.json()['id']}/answer", json={"answer": "run"}, headers=person,
                          timeout=30)
    assert approved.status_code == 200, approved.text
    expect(admin.page.locator("#badge")).to_be_hidden(timeout=3000)
    assert asked[before:] == [], asked[before:]  # pushed: the page sent no request for it


def test_cancel_a_running_task_started_by_requirements(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    admin.page.get_by_role("link", name="Tasks").click()  # requirements no device meets: said, nothing started
    admin.page.get_by_label("…or a plan").fill("- skill: get_system_info\n  args: {info_type: os}")
    admin.page.get_by_label("Required tags").fill("no-such-tag")
    admin.expected_errors.append("status of 409")  # the refusal the page shows is Chromium's console error too
    admin.page.get_by_role("button", name="Start").click()
    expect(admin.page.locator("#new-task [role=alert]")).to_contain_text("no-such-tag")
    admin.page.get_by_label("Required tags").fill("")
    start_plan(admin, f'[{{"skill": "shell.run", "args": {{"cmd": "sleep", "argv": ["60"], "cwd": "{cluster.tmp}"}}}}]',
               device="")
    expect(admin.page.get_by_text("Device: alpha")).to_be_visible()  # the only online device
    expect(admin.page.get_by_role("list", name="events")).to_contain_text("step_started")
    admin.page.get_by_role("button", name="Cancel task").click()
    expect(admin.page.locator("h1 .status")).to_have_text("cancelled")


def test_audit_and_tokens_views(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    for info in ("os", "cpu"):  # two audited commands of its own, whatever ran before
        cluster.remote.run("alpha", [Command(tool_name="get_system_info", parameters={"info_type": info})], timeout=30)
    admin.page.goto(f"{admin.base}/#/audit?limit=1")  # one row a page: the newest, then older ones
    table = admin.page.get_by_role("table", name="audit")
    expect(table).to_contain_text("cpu")
    admin.page.get_by_role("link", name="Older entries").click()
    expect(table).to_contain_text("os")
    expect(table).not_to_contain_text("cpu")
    admin.page.get_by_role("link", name="Audit").click()
    expect(admin.page.get_by_role("table", name="audit")).to_contain_text("alpha")
    admin.page.get_by_label("device").fill("alpha")
    admin.page.get_by_role("button", name="Filter").click()
    expect(admin.page.get_by_role("table", name="audit")).to_contain_text("alpha")
    admin.shot("audit")
    admin.page.get_by_role("link", name="Tokens").click()
    admin.page.get_by_label("Name").fill("made-in-browser")
    admin.page.get_by_role("checkbox", name="read").check()
    admin.page.get_by_role("button", name="Create").click()
    expect(admin.page.locator("#new-secret")).to_contain_text("tapi_")
    expect(admin.page.get_by_role("table", name="tokens")).to_contain_text("made-in-browser")
    admin.shot("tokens")


def test_read_only_token_sees_no_controls_and_the_server_refuses_anyway(browser: object, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    reader = Dash(browser, cluster, cluster.read_token)
    try:
        expect(row(reader, "alpha")).to_be_visible()
        expect(reader.page.get_by_role("link", name="Audit")).to_be_hidden()
        reader.page.get_by_role("link", name="alpha").click()
        expect(reader.page.get_by_text("Full profile")).to_be_visible()
        expect(reader.page.get_by_role("button", name="Run")).to_have_count(0)
        reader.page.get_by_role("link", name="Tasks").click()
        expect(reader.page.get_by_role("table", name="tasks")).to_be_visible()
        expect(reader.page.locator("#new-task")).to_have_count(0)
        reader.shot("read-only")
        reader.page.set_viewport_size({"width": 390, "height": 844})  # a phone
        reader.page.get_by_role("link", name="Devices").click()
        expect(row(reader, "alpha")).to_be_visible()
        reader.shot("devices-phone")
        refused = reader.context.request.post(
            f"{reader.base}/api/v1/devices/alpha/commands", headers={"X-CSRF-Token": reader.csrf()},
            data={"commands": [{"tool_name": "get_system_info", "parameters": {"info_type": "os"}}]})
        assert refused.status == 403 and "execute" in refused.json()["error"]
        reader.page.get_by_role("button", name="Log out").click()
        expect(reader.page.get_by_label("API token")).to_be_visible()
        assert reader.context.request.get(f"{reader.base}/api/v1/devices").status == 401  # the cookie is dead
    finally:
        reader.close()


def test_a_cross_site_form_post_is_refused(admin: Dash, cluster: Cluster) -> None:
    """A page on another origin of the same host (the same *site*: the browser sends the cookie)
    posts a form at the cancel endpoint; it is refused (its Origin names another port; without the CSRF
    header it would be refused too) and nothing changes."""
    from playwright.sync_api import expect

    start_plan(admin, f'[{{"skill": "shell.run", "args": {{"cmd": "sleep", "argv": ["60"], "cwd": "{cluster.tmp}"}}}}]')
    expect(admin.page.get_by_role("list", name="events")).to_contain_text("step_started")
    task_id = admin.page.url.rsplit("/", 1)[1]
    evil = f"http://127.0.0.1:{free_port()}/evil"
    page = admin.context.new_page()  # its console is not the dashboard's: not collected
    page.route(evil, lambda route: route.fulfill(content_type="text/html", body=(
        f'<form id=f method=post action="{admin.base}/api/v1/tasks/{task_id}/cancel"></form>'
        "<script>document.getElementById('f').submit()</script>")))
    with page.expect_navigation(url=f"{admin.base}/api/v1/tasks/{task_id}/cancel"):
        page.goto(evil)
    # refused by the Origin rule (another port is another origin, issue 27), before the CSRF check would
    assert "cross-site request from Origin" in page.content()
    page.close()
    state = httpx.get(f"{admin.base}/api/v1/tasks/{task_id}", headers={"Authorization": f"Bearer {cluster.api_token}"},
                      timeout=30).json()["state"]
    assert state == "running"
    admin.page.get_by_role("button", name="Cancel task").click()
    expect(admin.page.locator("h1 .status")).to_have_text("cancelled")


def test_docs_and_redoc_come_from_packaged_assets(browser: object, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    context = browser.new_context()  # type: ignore[attr-defined]
    page = context.new_page()
    outside: list[str] = []
    errors: list[str] = []
    # nothing is asked from outside (ReDoc's footer logo once was, from its CDN: blocked by the page's
    # Content-Security-Policy, a console error), and no console error either
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(
        (f"http://127.0.0.1:{cluster.port}/", "data:", "blob:")) else None)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(f"http://127.0.0.1:{cluster.port}/docs")
    expect(page.get_by_role("button", name="Authorize")).to_be_visible(timeout=WAIT_MS)
    answer = page.goto(f"http://127.0.0.1:{cluster.port}/redoc")
    assert answer is not None and "img-src 'self' data:" in answer.headers["content-security-policy"]
    expect(page.get_by_text("tether agent server").first).to_be_visible(timeout=WAIT_MS)
    context.close()
    assert not outside, f"fetched from outside the server: {outside}"
    assert not errors, f"console errors on /docs or /redoc: {errors}"
    document = httpx.get(f"http://127.0.0.1:{cluster.port}/openapi.json", timeout=30).json()
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "an API token (tether token create --api)"}
    assert document["paths"]["/api/v1/devices"]["get"]["security"] == [{"bearer": []}]
    assert "security" not in document["paths"]["/api/v1/health"]["get"]  # open to anyone


def test_login_csrf_plan_and_asset_errors_are_clear(cluster: Cluster) -> None:
    base = f"http://127.0.0.1:{cluster.port}"
    with httpx.Client(base_url=base, timeout=30) as http:
        for bad in ("nope", cluster.device_tokens["alpha"]):  # unknown, and a device token
            refused = http.post("/web/login", json={"token": bad})
            assert refused.status_code == 401 and "error" in refused.json() and "tether_session" not in refused.cookies
        assert http.post("/web/login", json={}).status_code == 422
        assert http.get("/web/session").json()["name"] is None
        login = http.post("/web/login", json={"token": cluster.api_token})
        cookie = login.headers["set-cookie"].lower()
        assert login.status_code == 200 and "httponly" in cookie and "samesite=strict" in cookie
        csrf = login.json()["csrf"]
        assert cluster.api_token not in login.text  # the page never sees the token again
        assert http.get("/api/v1/devices").status_code == 200  # the cookie alone reads
        no_header = http.post("/web/plan", json={"text": "- skill: x"})
        assert no_header.status_code == 403 and "CSRF" in no_header.json()["error"]
        wrong = http.post("/web/plan", json={"text": "- skill: x"}, headers={"X-CSRF-Token": "guess"})
        assert wrong.status_code == 403
        ok = http.post("/web/plan", json={"text": "steps:\n  - skill: read_file\n    args: {file_path: /x}"},
                       headers={"X-CSRF-Token": csrf})
        assert ok.json() == {"plan": [{"skill": "read_file", "args": {"file_path": "/x"}}]}
        for text in ("- [unclosed", "just words", "[]"):
            bad_plan = http.post("/web/plan", json={"text": text}, headers={"X-CSRF-Token": csrf})
            assert bad_plan.status_code == 400 and bad_plan.json()["error"], text
        for path in ("/web/static/../routes.py", "/web/static/%2e%2e/routes.py", "/web/static/nothing.js"):
            assert http.get(path).status_code == 404, path
        foreign = http.post("/web/login", json={"token": cluster.api_token}, headers={"Origin": "http://evil.example"})
        assert foreign.status_code == 403 and "cross-site" in foreign.json()["error"]
        sid = login.cookies["tether_session"]
        assert http.post("/web/logout").status_code == 403  # no CSRF token: a foreign page cannot log you out
        assert http.post("/web/logout", headers={"X-CSRF-Token": csrf}).status_code == 200
    with httpx.Client(base_url=base, timeout=30, cookies={"tether_session": sid}) as replay:
        assert replay.get("/api/v1/devices").status_code == 401  # the old cookie is dead on the server


def test_a_graph_task_shows_each_step_s_state_stage_and_needs(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    def echo(ident: str, needs: str) -> str:
        return (f"- {{id: {ident}, needs: [{needs}], skill: shell.run, "
                f"args: {{cmd: echo, argv: [{ident}], cwd: '{cluster.tmp}'}}}}\n")

    start_plan(admin, echo("one", "") + echo("two", "") + echo("both", "one, two"))
    join = admin.page.locator("[data-step='2']")
    expect(join).to_have_attribute("data-state", "done")  # refreshed live from the task's events
    expect(join.locator(".graph")).to_contain_text("stage 1 · id both · on alpha · needs one, two")
    expect(admin.page.locator("[data-step='0'] .graph")).to_contain_text("stage 0 · id one")
    # drawn by stage: two columns, the join in the second naming what it needs, each box in its state
    drawing = admin.page.locator("#graph")
    expect(drawing.locator(".gcol")).to_have_count(2)
    expect(drawing.locator(".gcol[data-stage='1'] .gnode[data-node='both']")).to_contain_text("\u2190 one, two")
    expect(drawing.locator(".gnode[data-state='done']")).to_have_count(3)
