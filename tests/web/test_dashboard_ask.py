"""Ask on miss from the dashboard: a task's shell command outside the device's allowlist waits for an
approval; an admin answers "always allow the program" on the task page, the step runs, and from then
on the program needs no approval on that device."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kits.netutil import Cluster, workspace_policy
from tests.web.test_dashboard import Dash, browser  # noqa: F401 (browser is a fixture)
from tether.protocol.models import Command


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    policy = workspace_policy(tmp_path, ask="on-miss")  # its steps' cwd, in /tmp: a write root of its own
    alpha = c.device("alpha", extra=("--policy", str(policy)))
    c.wait_online("alpha", alpha)
    yield c
    c.close()


def test_always_allow_from_the_task_page(browser: object, cluster: Cluster, tmp_path) -> None:  # noqa: F811
    from playwright.sync_api import expect

    step = {"skill": "shell.run", "args": {"cmd": "getconf", "argv": ["PAGE_SIZE"], "cwd": str(tmp_path)}}
    task = cluster.remote.create_task(plan=[step], device="alpha")
    admin = Dash(browser, cluster, cluster.api_token)
    try:
        admin.page.goto(f"{admin.base}/#/tasks/{task['id']}")
        question = admin.page.get_by_role("region", name="question")
        expect(question).to_contain_text("getconf")
        admin.shot("task-ask-on-miss")
        question.get_by_role("button", name="Always allow the program").click()
        expect(admin.page.locator("h1")).to_contain_text("done")
    finally:
        admin.close()
    _, [again] = cluster.remote.run("alpha", [Command(tool_name="shell.run", parameters=step["args"])], timeout=60)
    assert again.ok, again.error  # allowed for good: no approval asked
