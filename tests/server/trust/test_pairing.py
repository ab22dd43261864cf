"""Pairing end to end: a device with no token asks, an admin approves (or refuses) its code, and only
then does it get a token and run anything. Real server and device processes."""

from __future__ import annotations

import asyncio
import json
import re
import stat
import subprocess

import httpx
import pytest

from tests.kits.netutil import CLI, Cluster, wait_for
from tether.device.link.trust.device_key import DeviceKey
from tether.protocol.identity import claim_statement
from tether.protocol.models import Command
from tether.server.store import Store
from tether.server.trust.pairing import PairingBook, PairingError, PairingLimits

CODE = re.compile(r"pairing code: ([0-9A-Z]{4}-[0-9A-Z]{4})\s+device fingerprint: ([0-9a-f]{16})")


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def cli(cluster: Cluster, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args, "--server", f"http://127.0.0.1:{cluster.port}", "--token",
                           token or cluster.api_token], capture_output=True, text=True, env=cluster.env, timeout=60)


def pairing_device(cluster: Cluster, label: str, *extra: str):
    state = cluster.state / f"pair-{label}"
    proc = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--pair", "--name", label,
                          "--state-dir", str(state), *extra], f"pair-{label}")
    match = wait_for(lambda: CODE.search(proc.output()), f"{label}'s pairing code", 60, (proc.popen,))
    return proc, state, match.group(1), match.group(2)


def test_pair_approve_register_and_restart(cluster):
    proc, state, code, fingerprint = pairing_device(cluster, "laptop")

    pending = json.loads(cli(cluster, "devices", "pending", "--json").stdout)
    [row] = [r for r in pending if r["code"] == code]
    assert row["fingerprint"].startswith(fingerprint) and row["requested_name"] == "laptop"
    assert row["address"] == "127.0.0.1"
    # nothing of it is a device yet, and nothing can run on it
    assert all(d["name"] != "laptop" for d in cluster.remote.devices())
    assert not (state / "device.token").exists()

    done = cli(cluster, "devices", "approve", code.lower(), "--name", "laptop", "--tag", "lab")
    assert done.returncode == 0, done.stderr
    assert f"approved {code}" in done.stdout
    wait_for(lambda: "registered as laptop" in proc.output(), "registration after approval", 60, (proc.popen,))
    [view] = [d for d in cluster.remote.devices() if d["name"] == "laptop"]
    assert "lab" in view["tags"]
    _, [result] = cluster.remote.run("laptop", [Command(tool_name="get_system_info", parameters={})], timeout=30)
    assert result.ok

    token_file = state / "device.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "device.key").stat().st_mode) == 0o600
    assert token_file.read_text().startswith("tdev_")
    assert token_file.read_text().strip() not in proc.output()  # never printed
    assert json.loads(cli(cluster, "devices", "pending", "--json").stdout) == []

    # the next start needs no flag: the stored token, name and tags
    proc.stop()
    again = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--state-dir", str(state)],
                          "laptop-again")
    wait_for(lambda: "registered as laptop" in again.output(), "registration with the stored token", 60,
             (again.popen,))
    [view] = [d for d in cluster.remote.devices() if d["name"] == "laptop"]
    assert view["status"] != "offline" and "lab" in view["tags"]


def test_refused_device_gets_nothing(cluster):
    proc, state, code, _ = pairing_device(cluster, "stranger")
    done = cli(cluster, "devices", "refuse", code)
    assert done.returncode == 0, done.stderr
    assert proc.popen.wait(timeout=60) == 3
    assert "an admin refused this device" in proc.output()
    assert "Traceback" not in proc.output()
    assert not (state / "device.token").exists()
    assert all(d["name"] != "stranger" for d in cluster.remote.devices())
    # a decided code cannot be approved afterwards
    late = cli(cluster, "devices", "approve", code)
    assert late.returncode != 0 and "already refused" in late.stderr


def test_only_an_admin_decides(cluster):
    proc, _, code, _ = pairing_device(cluster, "waiting")
    denied = cli(cluster, "devices", "approve", code, token=cluster.read_token)
    assert denied.returncode != 0 and "admin" in denied.stderr
    assert "Traceback" not in denied.stderr
    listing = cli(cluster, "devices", "pending", token=cluster.read_token)
    assert listing.returncode != 0
    assert proc.popen.poll() is None  # still waiting, undecided


def _claim(key: DeviceKey, code: str, wait: float = 0) -> dict:
    return {"signature": key.sign(claim_statement(code, key.fingerprint)), "wait": wait}


def test_a_second_device_with_the_same_code_is_refused(cluster):
    base = f"http://127.0.0.1:{cluster.port}/api/v1/pairing"
    key, thief = DeviceKey.generate(), DeviceKey.generate()
    with httpx.Client(timeout=30) as http:
        asked = http.post(base, json={"public_key": key.public_key, "name": "one"})
        assert asked.status_code == 201
        code = asked.json()["code"]
        # the code alone (read off a screen) is not enough, before or after the approval
        # (answered as an unknown code is: a claim cannot tell whether a code exists, issue 27)
        stolen = http.post(f"{base}/{code}/claim", json=_claim(thief, code))
        assert stolen.status_code == 404 and "no pairing request" in stolen.json()["error"]
        assert cli(cluster, "devices", "approve", code).returncode == 0
        stolen = http.post(f"{base}/{code}/claim", json=_claim(thief, code))
        assert stolen.status_code == 404
        mine = http.post(f"{base}/{code}/claim", json=_claim(key, code))
        assert mine.status_code == 200 and mine.json()["token"].startswith("tdev_")
        twice = http.post(f"{base}/{code}/claim", json=_claim(key, code))
        assert twice.status_code == 409 and "error" in twice.json()
        unknown = http.post(f"{base}/ZZZZ-ZZZZ/claim", json=_claim(key, "ZZZZ-ZZZZ"))
        assert unknown.status_code == 404 and "error" in unknown.json()
        bad = http.post(base, json={"public_key": "not a key"})
        assert bad.status_code == 422 and "error" in bad.json()
        assert asked.json()["fingerprint"] == key.fingerprint


def test_pairing_requests_are_rate_limited_per_address(cluster):
    base = f"http://127.0.0.1:{cluster.port}/api/v1/pairing"
    with httpx.Client(timeout=30) as http:
        answers = [http.post(base, json={"public_key": DeviceKey.generate().public_key})
                   for _ in range(PairingLimits().per_address + 1)]
    assert [a.status_code for a in answers[:-1]] == [201] * PairingLimits().per_address
    assert answers[-1].status_code == 429 and "too many" in answers[-1].json()["error"]


def test_requests_expire_and_waiting_claims_are_woken(tmp_path):
    store = Store(tmp_path / "s.db")
    expired = PairingBook(store, PairingLimits(ttl=0.0))
    a, b = DeviceKey.generate(), DeviceKey.generate()
    code = asyncio.run(expired.request(a.public_key, "10.0.0.1", "old"))["code"]
    with pytest.raises(PairingError) as err:
        asyncio.run(expired.claim(code, _claim(a, code)["signature"], wait=5))
    assert err.value.status == 410
    assert asyncio.run(expired.pending()) == []
    with pytest.raises(PairingError) as err:
        asyncio.run(expired.approve(code, "old", [], "admin"))
    assert err.value.status == 410

    book = PairingBook(store)

    async def claim_while_approving() -> dict:
        code = (await book.request(b.public_key, "10.0.0.2", "new"))["code"]
        waiting = asyncio.ensure_future(book.claim(code, _claim(b, code)["signature"], wait=60))
        # callbacks run in the order they were scheduled: the claim's first step (up to its wait) goes first
        async def approve_while_it_waits() -> None:
            assert code in book._waiters  # the claim is waiting: the approval must wake it
            await book.approve(code, None, ["x"], "admin")

        approving = asyncio.ensure_future(approve_while_it_waits())
        got = await asyncio.wait_for(waiting, 10)
        await approving
        return got

    got = asyncio.run(claim_while_approving())
    assert got["status"] == "paired" and got["name"] == "new" and got["tags"] == ["x"]
    assert store.tokens.verify(got["token"]).name == "new"

    store.close()


def test_an_approval_lost_in_a_restart_is_undone(tmp_path):
    """The token's secret lives only in memory until claimed: after a restart the approval is undone
    (its token revoked), and the request waits for a new decision."""
    store = Store(tmp_path / "s.db")
    book = PairingBook(store)
    key = DeviceKey.generate()
    code = asyncio.run(book.request(key.public_key, "10.0.0.3", "lost"))["code"]
    token_id = asyncio.run(book.approve(code, None, [], "admin"))["token_id"]
    restarted = PairingBook(store)
    assert [r["code"] for r in asyncio.run(restarted.pending())] == [code]
    # the undone approval's key went with it
    assert [r["collision"] for r in asyncio.run(restarted.pending())] == [None]
    assert token_id not in store.tokens.active_ids()
    asyncio.run(restarted.approve(code, None, [], "admin"))
    assert asyncio.run(restarted.claim(code, _claim(key, code)["signature"], wait=0))["status"] == "paired"
    store.close()


def test_pairing_can_be_switched_off(tmp_path):
    from tests.kits.netutil import Proc, free_port, tether_env

    state = tmp_path / "state"
    state.mkdir()
    port = free_port()
    server = Proc(["server", "--port", str(port), "--db", str(state / "server.db"), "--no-pairing",
                   "--log-level", "warning"], tmp_path / "server.log", tether_env(state))
    try:
        base = f"http://127.0.0.1:{port}/api/v1"
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, "health", procs=(server.popen,))
        answer = httpx.post(f"{base}/pairing", json={"public_key": DeviceKey.generate().public_key})
        assert answer.status_code == 404 and "error" in answer.json()
    finally:
        server.stop()


def test_a_bad_name_is_refused_when_the_device_asks_in_words_not_a_pattern(tmp_path):
    """`--pair --name "my laptop"` is refused at the request (as at the approval), saying what would do; the
    device CLI says it before asking at all."""
    store = Store(tmp_path / "s.db")
    book = PairingBook(store)
    with pytest.raises(PairingError) as err:
        asyncio.run(book.request(DeviceKey.generate().public_key, "10.0.0.9", "my laptop"))
    assert err.value.status == 422
    assert "'my laptop' is not a device name" in str(err.value) and "'my-laptop'" in str(err.value)
    assert "[A-Za-z" not in str(err.value) and asyncio.run(book.pending()) == []
    code = asyncio.run(book.request(DeviceKey.generate().public_key, "10.0.0.9", "laptop"))["code"]
    with pytest.raises(PairingError) as err:
        asyncio.run(book.approve(code, "bad name!", [], "admin"))
    assert err.value.status == 422 and "(e.g. 'bad-name')" in str(err.value), err.value
    store.close()
    refused = subprocess.run([*CLI, "device", "--server", "ws://127.0.0.1:9", "--pair", "--name", "my laptop",
                              "--state-dir", str(tmp_path / "dev")], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "'my laptop' is not a device name" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
