"""TLS pinning for self-signed servers: the device trusts exactly the pinned certificate, refuses
any other before its token leaves, and pairing over https trusts the certificate on first use."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import CLI, Proc, free_port, tether_env, wait_for
from tether.client.rest import RemoteServer
from tether.device.link.trust.tls_pin import cert_fingerprint, normalize_fingerprint, show_fingerprint


@pytest.fixture
def tls_server(tmp_path, pki):
    paths = pki
    import ssl

    fingerprint = cert_fingerprint(ssl.PEM_cert_to_DER_cert(paths["cert"].read_text()))
    state = tmp_path / "state"
    state.mkdir()
    db = state / "server.db"
    device_token, api_token = dbkit.create_tokens(dbkit.server_db(db), [
        ("device", "pinned", []), ("api", "ops", ["read", "execute", "admin"])])
    env = tether_env(state)
    port = free_port()
    server = Proc(["server", "--port", str(port), *dbkit.server_db_args(db), "--tls-cert", str(paths["cert"]),
                   "--tls-key", str(paths["key"]), "--log-level", "warning"], tmp_path / "server.log", env)
    remote = RemoteServer(f"https://127.0.0.1:{port}", api_token, ca_file=str(paths["ca"]))
    wait_for(lambda: remote.health()["status"] == "ok", "https health", procs=(server.popen,))
    yield {"port": port, "fingerprint": fingerprint, "device_token": device_token, "api_token": api_token,
           "env": env, "remote": remote, "state": state, "server": server, "tmp": tmp_path, "ca": paths["ca"]}
    remote.close()
    server.stop()


def test_fingerprints_are_read_as_people_paste_them():
    raw = "ab" * 32
    assert normalize_fingerprint(show_fingerprint(raw)) == raw
    assert normalize_fingerprint("SHA256:" + raw.upper()) == raw
    with pytest.raises(ValueError, match="64 hex digits"):
        normalize_fingerprint("abc")


def test_the_server_prints_its_fingerprint(tls_server):
    assert tls_server["fingerprint"] in tls_server["server"].output()


def test_pinned_certificate_accepted_and_another_refused(tls_server):
    t = tls_server
    env = {**t["env"], "TETHER_DEVICE_TOKEN": t["device_token"]}
    url = f"wss://127.0.0.1:{t['port']}"
    wrong = Proc(["device", "--server", url, "--tls-fingerprint", "00" * 32, "--state-dir", str(t["tmp"] / "w")],
                 t["tmp"] / "wrong.log", env)
    try:
        assert wrong.popen.wait(timeout=60) == 3
        out = wrong.output()
        assert "not the pinned" in out and show_fingerprint(t["fingerprint"]) in out
        assert "Traceback" not in out
        assert all(d["name"] != "pinned" for d in t["remote"].devices())
    finally:
        wrong.stop()

    right = Proc(["device", "--server", url, "--tls-fingerprint", show_fingerprint(t["fingerprint"]),
                  "--state-dir", str(t["tmp"] / "r")], t["tmp"] / "right.log", env)
    try:
        wait_for(lambda: "registered as pinned" in right.output(), "registration with a pin", 60, (right.popen,))
    finally:
        right.stop()


def test_pairing_over_https_trusts_on_first_use(tls_server):
    t = tls_server
    state = t["tmp"] / "tofu"
    device = Proc(["device", "--server", f"wss://127.0.0.1:{t['port']}", "--pair", "--name", "tofu",
                   "--state-dir", str(state)], t["tmp"] / "tofu.log", t["env"])
    try:
        found = wait_for(lambda: re.search(r"pairing code: (\S+)", device.output()), "code", 60, (device.popen,))
        assert "trusting it on first use" in device.output() and t["fingerprint"] in device.output()
        done = subprocess.run([*CLI, "devices", "approve", found.group(1), "--server", f"https://127.0.0.1:{t['port']}",
                               "--token", t["api_token"], "--ca-file", str(t["ca"])], capture_output=True, text=True,
                              env=t["env"], timeout=60)
        assert done.returncode == 0, done.stderr
        wait_for(lambda: "registered as tofu" in device.output(), "registration after pairing", 60, (device.popen,))
        recorded = json.loads((state / "pairing.json").read_text())
        assert recorded["tls_fingerprint"] == t["fingerprint"]
    finally:
        device.stop()
    # the recorded fingerprint is the pin from now on: no CA file, no flag
    again = Proc(["device", "--server", f"wss://127.0.0.1:{t['port']}", "--state-dir", str(state)],
                 t["tmp"] / "tofu-again.log", t["env"])
    try:
        wait_for(lambda: "registered as tofu" in again.output(), "registration with the recorded pin", 60,
                 (again.popen,))
    finally:
        again.stop()
