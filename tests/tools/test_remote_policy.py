"""A device's policy governed from the server (issue 14, section 4): `tether policy` against a real
server and real device processes; the change applied, persisted across a device restart, audited,
and refused when the device forbids it or the change is not the server's to make."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import CLI, Cluster
from tether.client.rest import RemoteError, RemoteServer
from tether.server.store import Store


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cluster = Cluster(tmp)
        self.env = {**self.cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{self.cluster.port}",
                    "TETHER_TOKEN": self.cluster.api_token}
        self.alpha = self.start("alpha")
        closed = tmp / "closed.yaml"
        closed.write_text("policy_remote: false\n")
        self.beta = self.start("beta", closed)

    def start(self, name: str, policy: Path | None = None) -> Any:
        proc = self.cluster.device(name, extra=("--policy", str(policy)) if policy else ())
        self.cluster.wait_online(name, proc)
        return proc

    def tether(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **({"TETHER_TOKEN": token} if token else {})}
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120,
                              stdin=subprocess.DEVNULL)

    def show(self, device: str) -> dict[str, Any]:
        out = self.tether("policy", "show", "--device", device, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    def run(self, cmd: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.tether("exec", "--device", "alpha", "shell.run", f"cmd={cmd}", f"argv={json.dumps(list(argv))}",
                           f"cwd={self.tmp}")


@pytest.fixture
def setup(tmp_path):
    s = Setup(tmp_path)
    yield s
    s.cluster.close()


def test_set_allow_deny_persist_across_restart_and_audit(setup: Setup) -> None:
    before = setup.show("alpha")
    assert before["version"] == 0 and before["remote_allowed"] is True
    assert before["sources"]["commands"]["git"] == "default" and before["sources"]["max_output_bytes"] == "default"
    refused = setup.run("nproc")
    assert refused.returncode == 1 and "not-allowed" in refused.stdout + refused.stderr

    allowed = setup.tether("policy", "allow", "--device", "alpha", "nproc")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "policy version 1" in allowed.stdout
    ran = setup.run("nproc")
    assert ran.returncode == 0, ran.stdout + ran.stderr

    change = setup.tmp / "change.yaml"
    change.write_text("max_output_bytes: 4096\ncommands:\n  echo: null\n")
    applied = setup.tether("policy", "set", "--device", "alpha", "--file", str(change))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "policy version 2" in applied.stdout and "remote" in applied.stdout
    gone = setup.run("echo", "hi")
    assert gone.returncode == 1 and "not-allowed" in gone.stdout + gone.stderr

    setup.alpha.stop()  # a restart: the change was kept in the device's state directory
    setup.alpha = setup.start("alpha")
    after = setup.show("alpha")
    assert after["version"] == 2
    assert after["policy"]["max_output_bytes"] == 4096 and after["sources"]["max_output_bytes"] == "remote"
    assert after["sources"]["commands"]["nproc"] == "remote" and "nproc" in after["policy"]["commands"]
    assert after["sources"]["commands"]["echo"] == "remote (removed)" and "echo" not in after["policy"]["commands"]
    assert setup.run("nproc").returncode == 0
    stored = setup.cluster.state / "dev-alpha" / "remote-policy.json"
    assert stored.stat().st_mode & 0o777 == 0o600

    denied = setup.tether("policy", "deny", "--device", "alpha", "nproc")
    assert denied.returncode == 0 and "policy version 3" in denied.stdout
    assert setup.run("nproc").returncode == 1

    empty = setup.tmp / "empty.yaml"  # --replace: every earlier remote change goes
    empty.write_text("")
    assert setup.tether("policy", "set", "--device", "alpha", "--file", str(empty), "--replace").returncode == 0
    reset = setup.show("alpha")
    assert reset["version"] == 4 and reset["sources"]["max_output_bytes"] == "default"
    assert reset["sources"]["commands"]["echo"] == "default" and "nproc" not in reset["sources"]["commands"]

    store = Store(str(dbkit.server_db(setup.cluster.db)))
    try:
        rows = [r for r in store.audit.rows(limit=100, device="alpha") if r["tool_name"] == "policy.set"]
    finally:
        store.close()
    assert len(rows) == 4 and {r["status"] for r in rows} == {"success"}
    assert all(r["requested_by"] == "api:tests" for r in rows)


def test_refusals_change_nothing(setup: Setup) -> None:
    # the device forbids remote changes: it says so, and the server passes that on
    out = setup.tether("policy", "allow", "--device", "beta", "nproc")
    assert out.returncode == 1 and "policy_remote: false" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert setup.show("beta")["remote_allowed"] is False and setup.show("beta")["version"] == 0

    # settings that decide confinement are the device's own
    unsafe = setup.tmp / "unsafe.yaml"
    unsafe.write_text("sandbox: false\n")
    out = setup.tether("policy", "set", "--device", "alpha", "--file", str(unsafe))
    assert out.returncode == 1 and "can only be set in the device's own policy file" in out.stderr
    bad = setup.tmp / "bad.yaml"
    bad.write_text("commands:\n  sudo: {}\n")
    out = setup.tether("policy", "set", "--device", "alpha", "--file", str(bad))
    assert out.returncode == 1 and "always denied" in out.stderr
    bad.write_text("- not\n- a mapping\n")
    out = setup.tether("policy", "set", "--device", "alpha", "--file", str(bad))
    assert out.returncode == 2 and "mapping" in out.stderr
    out = setup.tether("policy", "set", "--device", "alpha", "--file", str(setup.tmp / "missing.yaml"))
    assert out.returncode == 2 and "cannot read" in out.stderr
    assert setup.show("alpha")["version"] == 0

    # a token without admin cannot change a policy (it can look)
    out = setup.tether("policy", "allow", "--device", "alpha", "nproc", token=setup.cluster.read_token)
    assert out.returncode == 1 and "lacks the 'admin' scope" in out.stderr
    assert setup.tether("policy", "show", "--device", "alpha", token=setup.cluster.read_token).returncode == 0
    with RemoteServer(f"http://127.0.0.1:{setup.cluster.port}", setup.cluster.api_token) as remote:
        with pytest.raises(RemoteError, match="allow") as err:
            remote.policy_program("alpha", "explode", "nproc")
        assert err.value.status == 422
        with pytest.raises(RemoteError, match="no device named 'nobody'"):
            remote.policy("nobody")
    setup.beta.stop()
    out = setup.tether("policy", "show", "--device", "beta")
    assert out.returncode == 1 and "offline" in out.stderr

    store = Store(str(dbkit.server_db(setup.cluster.db)))
    try:
        rows = [r for r in store.audit.rows(limit=100) if r["tool_name"] == "policy.set"]
    finally:
        store.close()
    assert rows and {r["status"] for r in rows} == {"failure"}  # refused changes are audited too


def test_a_damaged_stored_policy_stops_the_device_with_one_line(setup: Setup) -> None:
    assert setup.tether("policy", "allow", "--device", "alpha", "nproc").returncode == 0
    setup.alpha.stop()
    stored = setup.cluster.state / "dev-alpha" / "remote-policy.json"
    stored.write_text('{"version": 1, "overlay": {"sandbox": false}}')  # not the server's to set
    proc = setup.cluster.device("alpha")
    assert proc.popen.wait(timeout=60) == 2
    out = proc.output()
    assert "not a usable remote policy" in out and "remove it" in out and "Traceback" not in out
    stored.unlink()  # as the message says: the device starts again from its own policy
    setup.alpha = setup.start("alpha")
    assert setup.show("alpha")["version"] == 0 and "nproc" not in setup.show("alpha")["policy"]["commands"]


def test_a_network_host_list_round_trips_through_the_overlay() -> None:
    """`network: {allow, deny, ask}` survives the dump-and-validate of an effective policy and is reported as the
    device file's while the server has not set it."""
    from tether.tools.policy.model import NetworkRules, policy_from_mapping
    from tether.tools.policy.overlay import effective, sources

    rules = {"allow": ["pypi.org:443", "*.githubusercontent.com", "10.0.0.0/8"], "deny": ["evil.test"],
             "ask": "on-miss"}
    base = policy_from_mapping({"network": rules})
    after = effective(base, {"max_output_bytes": 4096, "commands": {"nproc": {}}})
    assert after.network == NetworkRules(**rules) and after.max_output_bytes == 4096
    assert json.loads(after.model_dump_json())["network"] == {**rules, "within": None}
    assert sources(base, {})["network"] == "file"
    assert effective(policy_from_mapping({"network": "off"}), {}).network is False


LIST = {"allow": ["*.example.com", "10.0.0.0/8", "pypi.org:443", "localhost:8000"], "deny": ["bad.example.com"]}


@pytest.mark.parametrize(("device", "pushed", "expected"), [
    (True, "on", True),
    (True, "off", False),
    (False, "off", False),
    (False, {"allow": ["*"]}, False),  # the device's off stays off
    (LIST, "off", False),
    (True, {"allow": ["pypi.org"]}, {"allow": ["pypi.org"], "deny": [], "ask": "off", "within": None}),
    (LIST, {"allow": ["a.example.com", "*.b.example.com", "example.com", "10.1.0.0/16", "10.2.3.4:80", "pypi.org",
                      "localhost:9000", "evil.test"], "deny": ["x.example.com"]},
     {"allow": ["a.example.com", "*.b.example.com", "10.1.0.0/16", "10.2.3.4:80", "pypi.org:443"],
      "deny": ["bad.example.com", "x.example.com"], "ask": "off", "within": LIST}),
])
def test_a_pushed_network_only_narrows_the_devices_own(device: Any, pushed: Any, expected: Any) -> None:
    from tether.tools.policy.model import policy_from_mapping
    from tether.tools.policy.overlay import check_overlay, effective, sources

    base = policy_from_mapping({"network": device})
    overlay = check_overlay({"network": pushed})
    after = effective(base, overlay)
    got = after.model_dump(mode="json")["network"]
    if isinstance(expected, dict) and expected["within"] is not None:
        expected = {**expected, "within": {"ask": "off", "within": None, **expected["within"]}}
    assert got == expected
    assert sources(base, overlay)["network"] == "remote"


@pytest.mark.parametrize(("device", "pushed", "why"), [
    (LIST, "on", "network: on would widen this device's own host list"),
    (False, "on", "network: on would widen this device's own network: off"),
    (LIST, {"allow": ["pypi.org"], "ask": "on-miss"}, "network.ask: on-miss would let a person open hosts"),
    (LIST, {"allow": ["pypi.org"], "within": {"allow": ["*"]}}, "network.within is the device's own list"),
    (LIST, {"allow": ["pypi.org:99999"]}, "is not a port"),
    (LIST, "sideways", "network is on, off, or"),
])
def test_a_pushed_network_that_would_widen_is_refused_with_its_reason(device: Any, pushed: Any, why: str) -> None:
    from tether.tools.policy.model import policy_from_mapping
    from tether.tools.policy.overlay import effective

    with pytest.raises(ValueError, match=re.escape(why)):
        effective(policy_from_mapping({"network": device}), {"network": pushed})


def test_the_narrowed_rules_hold_the_devices_own_at_every_step() -> None:
    """What the intersection cannot say, `within` does: a name the server lists exactly but the device only by
    wildcard does not open a private address; a device's ask still asks, and an "always" answer opens both."""
    import ipaddress

    from tether.tools.policy.model import policy_from_mapping
    from tether.tools.policy.overlay import effective
    from tether.tools.running.sandboxing import egress_rules

    device = policy_from_mapping({"network": {"allow": ["*.example.com"], "ask": "on-miss"}})
    narrowed = effective(device, {"network": {"allow": ["intra.example.com", "other.test"], "ask": "on-miss"}})
    rules = egress_rules(narrowed)
    assert rules is not None and [e.text for e in rules.allow] == ["intra.example.com"]
    assert rules.judge_name("intra.example.com", 443).allowed
    private = rules.judge_address("intra.example.com", ipaddress.ip_address("10.1.2.3"), 443)
    assert not private.allowed and private.rule == "network.special-address"
    assert "the device's own network policy" in private.reason
    assert rules.judge_address("intra.example.com", ipaddress.ip_address("93.184.216.34"), 443).allowed
    miss = rules.judge_name("other.test", 443)
    assert (miss.allowed, miss.rule, miss.ask) == (False, "network.not-allowed", True)
    always = rules.with_allowed("other.test", 443)
    assert always.judge_name("other.test", 443).allowed
    assert not always.judge_name("other.test", 80).allowed
