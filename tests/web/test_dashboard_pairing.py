"""Pairing from the dashboard: a device asking to pair shows up for an admin with its code and
fingerprint, is approved under a name and a tag, and registers; a reader sees no pairing panel."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.kits.netutil import Cluster, wait_for
from tests.web.test_dashboard import Dash, browser, row  # noqa: F401 (browser is a fixture)

CODE = re.compile(r"pairing code: ([0-9A-Z]{4}-[0-9A-Z]{4})\s+device fingerprint: ([0-9a-f]{16})")


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def test_approve_a_pairing_device_from_the_dashboard(browser: object, cluster: Cluster) -> None:  # noqa: F811
    from playwright.sync_api import expect

    admin = Dash(browser, cluster, cluster.api_token)  # open before the device asks: the request shows live
    try:
        device = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--pair", "--name", "kiosk",
                                "--state-dir", str(cluster.state / "kiosk")], "kiosk")
        code, fingerprint = wait_for(lambda: CODE.search(device.output()), "pairing code", 60, (device.popen,)).groups()
        request = admin.page.locator(f'tr[data-pairing="{code}"]')
        expect(request).to_contain_text(fingerprint)
        request.get_by_label(f"name for {code}").fill("kiosk-1")
        request.get_by_label(f"tags for {code}").fill("lobby, lab")
        admin.shot("pairing")
        request.get_by_role("button", name="Approve").click()
        expect(row(admin, "kiosk-1")).to_contain_text("online")
        expect(row(admin, "kiosk-1")).to_contain_text("lobby, lab")
        expect(admin.page.locator("#pairing")).not_to_contain_text(code)
    finally:
        admin.close()

    reader = Dash(browser, cluster, cluster.read_token)
    try:
        expect(row(reader, "kiosk-1")).to_be_visible()
        expect(reader.page.locator("#pairing table")).to_have_count(0)
    finally:
        reader.close()


def test_a_request_naming_an_existing_device_is_marked_and_replaced_only_when_ticked(
        browser: object, cluster: Cluster) -> None:  # noqa: F811
    from playwright.sync_api import expect

    real = cluster.device("alpha")
    cluster.wait_online("alpha", real)
    device = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--pair", "--name", "alpha",
                            "--state-dir", str(cluster.state / "alpha-new")], "alpha-new")
    code, _ = wait_for(lambda: CODE.search(device.output()), "pairing code", 60, (device.popen,)).groups()
    admin = Dash(browser, cluster, cluster.api_token)
    try:
        request = admin.page.locator(f'tr[data-pairing="{code}"]')
        expect(request.locator(f'[data-collision="{code}"]')).to_contain_text("exists")
        admin.shot("pairing-collision")
        admin.expected_errors.append("status of 409")  # the refusal the page shows is Chromium's console error too
        request.get_by_role("button", name="Approve").click()  # as shown: refused, the name stays alpha's
        expect(admin.page.locator("#toast")).to_contain_text("exists")
        assert cluster.status("alpha") in ("online", "busy") and real.popen.poll() is None
        request.get_by_label(f"replace the existing device for {code}").check()
        request.get_by_role("button", name="Approve").click()
        expect(admin.page.locator("#pairing")).not_to_contain_text(code)
    finally:
        admin.close()
    assert real.popen.wait(timeout=60) == 3  # the replaced device is cut off and refused
    wait_for(lambda: "registered as alpha" in device.output(), "the new alpha registers", 60, (device.popen,))
