"""The dashboard's management pages in the system Chromium (Playwright) against a real `tether server` and a
real `tether device`: a device's tags, policy and removal; a readable audit log (meta calls hidden, relative
times with the exact one on hover); tokens with id, created and last used, revoked only after a confirmation;
a task's file changes as diffs, escaped; the approval inbox; webhooks (a delivery received by a local HTTP
server). Then every page through axe-core (from npm, see scripts/test) at 1280 and 390 px: no serious or
critical violation, no horizontal overflow on a phone. Screenshots are kept as artifacts; any JavaScript or
console error fails the test (the Dash helper of test_dashboard)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.kits.netutil import Cluster
from tests.web.test_dashboard import WAIT_MS, Dash, browser, start_plan  # noqa: F401 - browser: the module fixture
from tether.protocol.models import Command

ROOT = Path(__file__).resolve().parents[2]
AXE = Path(os.environ.get("TETHER_AXE_JS") or ROOT / ".tether-test-node/node_modules/axe-core/axe.min.js")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("manage"), ("--set", "webhook_allow_private=true"))
    alpha = c.device("alpha")
    c.wait_online("alpha", alpha)
    yield c
    c.close()


@pytest.fixture
def admin(browser: object, cluster: Cluster) -> Iterator[Dash]:  # noqa: F811 - the imported module fixture
    dash = Dash(browser, cluster, cluster.api_token)
    yield dash
    dash.close()


def call(cluster: Cluster, method: str, path: str, body: Any = None) -> Any:
    answer = httpx.request(method, f"http://127.0.0.1:{cluster.port}/api/v1{path}", json=body, timeout=30,
                           headers={"Authorization": f"Bearer {cluster.api_token}"})
    assert answer.status_code < 300, answer.text
    return answer.json()


def test_a_device_s_tags_policy_and_removal(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    page = admin.page
    page.get_by_role("link", name="alpha").click()
    page.get_by_label("Tags (comma-separated)").fill("lab, gpu")
    page.get_by_role("button", name="Save tags").click()
    expect(page.locator("#toast")).to_contain_text("saved alpha")
    page.locator("#toast").get_by_role("button", name="dismiss").click()  # toasts close (and go by themselves)
    expect(page.locator("#toast")).to_be_empty()
    assert call(cluster, "GET", "/devices/alpha")["tags"] == ["lab", "gpu"]
    page.locator("#policy summary").click()
    expect(page.get_by_role("table", name="policy")).to_contain_text("write_roots")
    page.get_by_label("Rename to").fill("alpha-2")  # connected: refused, and said so in words
    admin.expected_errors.append("status of 409")
    page.get_by_role("button", name="Rename").click()
    expect(page.locator("#device-actions [role=alert]")).to_contain_text("connected")
    admin.shot("device-manage")
    gone = cluster.device("beta")  # a second device, stopped, then forgotten from the dashboard
    cluster.wait_online("beta", gone)
    page.goto(f"{admin.base}/#/devices/beta")
    # clicked at once: until beta's page is drawn, alpha's (and its own Remove device) is inert, so the click
    # waits for beta's button
    page.get_by_role("button", name="Remove device").click()  # asks first
    question = page.locator("#device-actions").get_by_role("alert").filter(has_text="Remove beta?")
    expect(question).to_be_visible()
    expect(page.get_by_role("heading", name="Device beta")).to_be_visible()
    expect(page.locator("#device-status")).to_have_text("online")
    gone.stop()  # the page follows its status as the server pushes it, in place: the question stays open
    expect(page.locator("#device-status")).to_have_text("offline", timeout=60_000)
    expect(question).to_be_visible()
    assert call(cluster, "GET", "/devices?name=beta") != []
    page.get_by_role("button", name="Yes, remove device").click()
    expect(page.get_by_role("heading", name="Devices")).to_be_visible()
    expect(page.locator('tr[data-device="beta"]')).to_have_count(0)
    assert call(cluster, "GET", "/devices?name=beta") == []


def test_the_audit_log_is_readable_and_hides_meta_calls(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    cluster.remote.run("alpha", [Command(tool_name="get_system_info", parameters={"info_type": "os"})], timeout=30)
    admin.page.get_by_role("link", name="alpha").click()  # the device page lists its tools: a meta call
    expect(admin.page.get_by_text("Full profile")).to_be_visible()
    admin.page.get_by_role("link", name="Audit").click()
    table = admin.page.get_by_role("table", name="audit")
    expect(table.locator("thead")).to_have_text("WhenDeviceToolOutcomeCallerArguments")
    first = table.locator("tbody tr").first
    expect(first).to_contain_text("get_system_info")
    expect(first).to_contain_text("info_type=os")
    expect(first.locator("td").nth(4)).to_have_text("tests")  # the token's name, not api:tests
    stamp = first.locator("time")
    expect(stamp).to_have_text("just now")
    assert stamp.get_attribute("title")  # the exact time on hover
    expect(table).not_to_contain_text("list_tools")
    admin.page.get_by_label("meta calls").check()
    admin.page.get_by_role("button", name="Filter").click()
    expect(admin.page.get_by_role("table", name="audit")).to_contain_text("list_tools")
    assert "meta=1" in admin.page.url  # the filter is kept in the address
    admin.page.get_by_label("tool", exact=True).fill("no-such-tool")
    admin.page.get_by_role("button", name="Filter").click()
    expect(admin.page.get_by_role("table", name="audit")).to_contain_text("Only meta calls or other outcomes")
    admin.shot("audit-readable")


def test_tokens_show_when_made_and_used_and_revoking_asks_first(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    made = call(cluster, "POST", "/tokens", {"kind": "api", "name": "to-revoke", "scopes": ["read"]})
    httpx.get(f"http://127.0.0.1:{cluster.port}/api/v1/devices", timeout=30,
              headers={"Authorization": f"Bearer {made['token']}"})  # used once
    admin.page.get_by_role("link", name="Tokens").click()
    table = admin.page.get_by_role("table", name="tokens")
    expect(table.locator("thead")).to_contain_text("Last used")
    row = table.locator(f'tr[data-token="{made["info"]["id"]}"]')
    expect(row.locator("td").nth(1)).to_have_text(made["info"]["id"][:12])
    expect(row.locator("td").nth(6).locator("time")).to_have_text("just now")
    expect(table.locator("tr", has_text="(you)")).to_have_count(1)
    row.get_by_role("button", name="Revoke").click()
    expect(row.get_by_role("alert")).to_contain_text("Revoke to-revoke?")
    row.get_by_role("button", name="Keep it").click()  # changed its mind: nothing happened
    assert not next(t for t in call(cluster, "GET", "/tokens") if t["name"] == "to-revoke")["revoked_at"]
    row.get_by_role("button", name="Revoke").click()
    row.get_by_role("button", name="Yes, revoke").click()
    expect(table.locator(f'tr[data-token="{made["info"]["id"]}"]')).to_contain_text("revoked")
    admin.shot("tokens-columns")
    admin.page.get_by_role("button", name="Log out").click()  # nothing of the session stays on the page
    expect(admin.page.get_by_label("API token")).to_be_visible()
    expect(admin.page.locator("#nav")).to_be_hidden()
    expect(admin.page.locator("#who")).to_be_empty()


def test_a_task_lists_its_changes_as_escaped_diffs(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    work = cluster.tmp / "changes"
    work.mkdir()
    hostile = work / "<img src=x onerror=window.pwned=1>.html"
    content = '<script>window.pwned=2</script>\n<b onmouseover="window.pwned=3">bold</b>\nlast line\n'
    plan = json.dumps([{"skill": "write_file", "args": {"file_path": str(hostile), "content": content}},
                       {"skill": "shell.run", "args": {"cmd": "cp", "argv": [str(hostile), str(work / "copy.txt")],
                                                        "cwd": str(work)}}])
    start_plan(admin, plan)
    expect(admin.page.locator("h1 .status")).to_have_text("done")
    changes = admin.page.get_by_role("region", name="changes")
    expect(changes.get_by_role("heading")).to_have_text("Changes (2)")
    written = changes.locator("[data-changes-step='0'] details.file")
    expect(written).to_have_attribute("data-kind", "created")
    expect(written.locator("summary code")).to_have_text(str(hostile))
    expect(written.locator("pre.diff .add")).to_have_text(["+" + line for line in content.splitlines()])
    copied = changes.locator("[data-changes-step='1'] details.file")
    expect(copied.locator("summary code")).to_have_text(str(work / "copy.txt"))
    expect(copied).to_have_attribute("data-kind", "created")
    assert changes.locator("img, script, b").count() == 0  # text, never markup
    written.locator("pre.diff .add").nth(1).hover()
    assert admin.page.evaluate("window.pwned") is None
    admin.shot("task-changes")


def test_a_held_step_waits_and_shows_what_would_change(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    doomed = cluster.tmp / "held"
    doomed.mkdir()
    (doomed / "notes.txt").write_text("x")
    page = admin.page
    page.get_by_role("link", name="alpha").click()
    page.locator("#policy summary").click()
    page.get_by_label("Program").fill("rm")  # from the dashboard: rm asks a person each run on alpha
    page.get_by_role("button", name="Ask a person each run").click()
    expect(page.locator("#toast")).to_contain_text("rm: needs approval on alpha")
    expect(page.locator('#policy tr[data-setting="commands"]')).to_contain_text("rm (a person approves)")
    start_plan(admin, json.dumps([{"skill": "shell.run", "args": {"cmd": "rm", "argv": ["-r", str(doomed)],
                                                                   "cwd": str(cluster.tmp)}}]))
    question = page.locator("#question")
    expect(question).to_contain_text("Approval needed")
    expect(question).to_contain_text("the policy asks before rm runs")
    step = page.locator("[data-step='0']")
    expect(step).to_contain_text("held for approval")  # waiting, not a red "failed"
    expect(step.locator(".s-failed")).to_have_count(0)
    admin.shot("task-held")
    assert doomed.exists()
    question.get_by_role("button", name="approve").click()
    expect(page.locator("h1 .status")).to_have_text("done")
    changes = page.get_by_role("region", name="changes")
    expect(changes.locator("details.file[data-kind='deleted']").first).to_be_visible()
    assert not doomed.exists()


def test_overwrites_show_before_and_after_diffs_held_and_applied(admin: Dash, cluster: Cluster) -> None:
    """A real device overwrites a file through `write_file` and through a sandboxed `sed -i`; each file has a
    second name (a hard link), so each change waits for a person: the approval card shows the diff of what
    it would change, the task's Changes the applied diff, the REST task carries it, and hostile content
    stays text."""
    from playwright.sync_api import expect

    work = cluster.tmp / "diffs"
    work.mkdir()
    page_file, conf = work / "page.html", work / "app.conf"
    page_file.write_text('<img src=x onerror="window.pwned=4">\nkeep me\n')
    conf.write_text("port=80\nhost=<script>window.pwned=5</script>\n")
    for f in (page_file, conf):
        os.link(f, work / f"{f.name}.link")
    new_page = '<img src=y onerror="window.pwned=6">\nkeep me\n'
    start_plan(admin, json.dumps([
        {"skill": "write_file", "args": {"file_path": str(page_file), "content": new_page, "mode": "overwrite"}},
        {"skill": "shell.run", "args": {"cmd": "sed", "argv": ["-i", "s/port=80/port=8080/", str(conf)],
                                         "cwd": str(work)}}]))
    page = admin.page
    question = page.locator("#question")
    for removed, added in (('-<img src=x onerror="window.pwned=4">', '+<img src=y onerror="window.pwned=6">'),
                           ("-port=80", "+port=8080")):
        held = question.locator("details.file")  # what approving would change, before anything is applied
        expect(held.locator("pre.diff .del")).to_have_text([removed])
        expect(held.locator("pre.diff .add")).to_have_text([added])
        expect(held.locator("summary .minus")).to_have_text(" \u22121")
        if removed.startswith("-<img"):
            admin.shot("task-held-diff")
            assert page_file.read_text().startswith("<img src=x")
        else:
            assert conf.read_text().startswith("port=80\n")
        question.get_by_role("button", name="approve").click()
    expect(page.locator("h1 .status")).to_have_text("done")
    changes = page.get_by_role("region", name="changes")
    expect(changes.get_by_role("heading")).to_have_text("Changes (2)")
    for step, (removed, added) in enumerate((('-<img src=x onerror="window.pwned=4">',
                                              '+<img src=y onerror="window.pwned=6">'), ("-port=80", "+port=8080"))):
        entry = changes.locator(f"[data-changes-step='{step}'] details.file")
        expect(entry).to_have_attribute("data-kind", "modified")
        expect(entry.locator("pre.diff .del")).to_have_text([removed])
        expect(entry.locator("pre.diff .add")).to_have_text([added])
        expect(entry.locator("pre.diff .ctx").first).to_contain_text("keep me" if step == 0 else "host=<script>")
    entry.locator("summary").click()  # collapsible per file
    expect(entry.locator("pre.diff")).to_be_hidden()
    assert changes.locator("img, script").count() == 0 and question.count() == 0
    changes.locator("pre.diff .del").first.hover()
    assert page.evaluate("window.pwned") is None
    admin.shot("task-diffs")
    expect(page.get_by_role("list", name="events")).to_contain_text("-port=80\\n+port=8080")  # in the step's event
    task = call(cluster, "GET", f"/tasks/{page.url.rsplit('/', 1)[1]}")
    done = [r for r in task["steps"] if r["result"]["status"] == "success"]
    assert '+<img src=y onerror="window.pwned=6">' in done[0]["result"]["result"]["diff"]
    [sed] = [c for c in done[1]["result"]["result"]["changes"] if c["path"] == str(conf)]
    assert "-port=80\n+port=8080\n" in sed["diff"] and (sed["added"], sed["removed"]) == (1, 1)
    assert conf.read_text() == "port=8080\nhost=<script>window.pwned=5</script>\n"  # sed -i renames a new file in
    assert (work / "page.html.link").read_text() == new_page  # write_file writes the file both names share


class Hooks(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Receiver)
        self.bodies: list[dict[str, Any]] = []
        self.got = threading.Condition()


class Receiver(BaseHTTPRequestHandler):
    server: Hooks

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(204)
        self.end_headers()
        with self.server.got:
            self.server.bodies.append(body)
            self.server.got.notify_all()

    def log_message(self, *_: Any) -> None:
        pass


def test_the_inbox_answers_and_the_webhooks_page_adds_tests_and_removes(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    page = admin.page
    page.get_by_role("link", name="Inbox").click()
    expect(page.locator("#main")).to_contain_text("Nothing waits for you.")
    plan = [{"skill": "write_file", "args": {"file_path": str(cluster.tmp / "inbox.txt"), "content": "x"}}]
    task = call(cluster, "POST", "/tasks", {"device": "alpha", "confirm": "always", "plan": plan})
    item = page.locator(f'[data-item="{task["id"]}"]')  # the page follows the inbox's pushed changes
    expect(item).to_contain_text("confirmation")
    admin.shot("inbox")
    item.get_by_role("button", name="Approve").click()
    expect(page.locator("#main")).to_contain_text("Nothing waits for you.")
    assert call(cluster, "GET", f"/tasks/{task['id']}?events=false")["state"] in ("running", "done")

    hooks = Hooks()
    threading.Thread(target=hooks.serve_forever, daemon=True).start()
    try:
        page.get_by_role("link", name="Webhooks").click()
        expect(page.locator("#main")).to_contain_text("No webhooks yet")
        page.get_by_label("URL").fill(f"http://127.0.0.1:{hooks.server_address[1]}/hook?key=s3cret")
        page.get_by_role("button", name="Add").click()
        expect(page.locator("#webhook-secret")).not_to_be_empty()
        card = page.locator("[data-webhook]")
        expect(card.locator(".url")).not_to_contain_text("s3cret")  # listed redacted
        card.get_by_role("button", name="Send a test").click()
        with hooks.got:
            assert hooks.got.wait_for(lambda: any(b.get("event") == "ping" for b in hooks.bodies), WAIT_MS / 1000)
        card.get_by_role("button", name="Deliveries").click()
        expect(card.get_by_role("table")).to_contain_text("delivered")
        admin.shot("webhooks")
        card.get_by_role("button", name="Remove").click()
        card.get_by_role("button", name="Yes, remove").click()
        expect(page.locator("#main")).to_contain_text("No webhooks yet")
        assert call(cluster, "GET", "/webhooks") == []
    finally:
        hooks.shutdown()
        hooks.server_close()


def test_an_inbox_push_redraws_only_the_card_that_changed(admin: Dash, cluster: Cluster) -> None:
    """A card whose item did not change is the same DOM node after pushes that add and remove other cards, and
    the person's focus in it stays; what the server sends goes in as text."""
    from playwright.sync_api import expect

    page = admin.page
    page.get_by_role("link", name="Inbox").click()
    expect(page.locator("#main")).to_contain_text("Nothing waits for you.")

    made: list[str] = []

    def waiting(content: str) -> str:  # a task waiting for its plan to be confirmed, writing a file of its own
        made.append(content)
        path = cluster.tmp / f"inbox-{len(made)}.txt"
        plan = [{"skill": "write_file", "args": {"file_path": str(path), "content": content}}]
        return str(call(cluster, "POST", "/tasks", {"device": "alpha", "confirm": "always", "plan": plan})["id"])

    kept, other = waiting("<b>kept</b>"), waiting("other")
    card = page.locator(f'[data-item="{kept}"]')
    expect(card).to_contain_text("confirmation")
    expect(page.locator(f'[data-item="{other}"]')).to_be_visible()
    node = card.element_handle()
    card.get_by_role("button", name="Deny").focus()
    focused = ("() => document.activeElement.closest('[data-item]')?.dataset.item + ' ' "
               "+ document.activeElement.textContent")
    assert page.evaluate(focused) == f"{kept} Deny"

    added = waiting("added")  # a push that adds a card
    expect(page.locator(f'[data-item="{added}"]')).to_be_visible()
    call(cluster, "POST", f"/tasks/{other}/approval", {"approved": False})  # a push that removes one
    expect(page.locator(f'[data-item="{other}"]')).to_have_count(0)
    assert node.evaluate("(el) => el.isConnected && el === document.querySelector(`[data-item='${el.dataset.item}']`)")
    assert page.evaluate(focused) == f"{kept} Deny", "the person's focus was lost to a push about another card"
    expect(card).to_contain_text("<b>kept</b>")  # the plan's markup is text, never parsed
    assert page.locator("#main b").count() == 0
    for task_id in (kept, added):  # nothing left waiting for the module's other tests (they run: done)
        call(cluster, "POST", f"/tasks/{task_id}/approval", {"approved": True})
    expect(page.locator("#main")).to_contain_text("Nothing waits for you.")


AXE_RUN = """async () => (await axe.run(document, {resultTypes: ['violations']})).violations
    .filter((v) => v.impact === 'serious' || v.impact === 'critical')
    .map((v) => `${v.id} (${v.impact}): ${v.nodes.slice(0, 3).map((n) => n.target.join(' ')).join(', ')}`)"""
PAGES = ["#/devices", "#/devices/alpha", "#/tasks", "#/audit", "#/tokens", "#/inbox", "#/webhooks"]


def test_every_page_passes_axe_and_fits_a_phone(admin: Dash, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    if not AXE.is_file():
        pytest.fail(f"axe-core is missing ({AXE}): scripts/test installs it (npm install --prefix .tether-test-node "
                    "axe-core), or point TETHER_AXE_JS at axe.min.js")
    task = call(cluster, "GET", "/tasks?limit=1")  # a task page too, with steps (the earlier tests made some)
    pages = [*PAGES, f"#/tasks/{task[0]['id']}"] if task else PAGES
    page = admin.page
    outside: list[str] = []  # nothing is fetched from anywhere but the server
    page.on("request", lambda r: outside.append(r.url) if not r.url.startswith((admin.base + "/", "data:")) else None)
    page.evaluate(AXE.read_text(encoding="utf-8") + "\n;0")  # through the debugger: the page's CSP stays on
    found: dict[str, list[str]] = {}
    for width, height in ((1280, 800), (390, 844)):
        page.set_viewport_size({"width": width, "height": height})
        for where in pages:
            page.goto(f"{admin.base}/{where}")
            expect(page.locator("#main h1")).to_be_visible()
            bad = page.evaluate(AXE_RUN)
            if bad:
                found[f"{where} at {width}px"] = bad
            if width == 390:
                overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
                if overflow > 0:
                    found.setdefault(f"{where} at 390px", []).append(f"{overflow} px wider than the screen")
                admin.shot(f"phone-{where.strip('#/').replace('/', '-') or 'home'}")
    assert not found, found
    assert not outside, outside
