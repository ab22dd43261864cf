"""TLS end to end: `wss://` and `https://` with a certificate the device and CLI verify."""

from __future__ import annotations

import subprocess

import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import CLI, Proc, free_port, tether_env, wait_for, workspace_policy
from tether.client.rest import RemoteError, RemoteServer
from tether.protocol.models import Command


def test_device_and_cli_over_tls(tmp_path, pki):
    state = tmp_path / "state"
    state.mkdir()
    db = state / "server.db"
    device_token, api_token = dbkit.create_tokens(dbkit.server_db(db), [
        ("device", "secure", []), ("api", "ops", ["read", "execute"])])
    env = tether_env(state)
    port = free_port()
    procs = []
    try:
        server = Proc(["server", "--port", str(port), *dbkit.server_db_args(db), "--tls-cert", str(pki["cert"]),
                       "--tls-key", str(pki["key"]), "--log-level", "warning"], tmp_path / "server.log", env)
        procs.append(server)
        remote = RemoteServer(f"https://127.0.0.1:{port}", api_token, ca_file=str(pki["ca"]))
        wait_for(lambda: remote.health()["status"] == "ok", "https health", procs=(server.popen,))
        with pytest.raises(RemoteError, match="cannot reach"):
            RemoteServer(f"https://127.0.0.1:{port}", api_token).health()  # not trusted without the CA

        device_env = {**env, "TETHER_DEVICE_TOKEN": device_token}  # never on a command line
        untrusting = Proc(["device", "--server", f"wss://127.0.0.1:{port}", "--state-dir", str(state / "d0")],
                          tmp_path / "untrusting.log", device_env)
        procs.append(untrusting)
        wait_for(lambda: "certificate" in untrusting.output().lower(), "certificate refusal in the log", 60,
                 (untrusting.popen,))
        untrusting.stop()

        device = Proc(["device", "--server", f"wss://127.0.0.1:{port}", "--ca-file", str(pki["ca"]),
                       "--state-dir", str(state / "d1"), "--policy", str(workspace_policy(tmp_path))],
                      tmp_path / "device.log", device_env)
        procs.append(device)
        wait_for(lambda: any(d["name"] == "secure" and d["status"] != "offline" for d in remote.devices()),
                 "device over wss", 60, (device.popen,))
        _, [result] = remote.run("secure", [Command(tool_name="shell.run", parameters={
            "cmd": "echo", "argv": ["over tls"], "cwd": str(tmp_path)})], timeout=30)
        assert result.ok and result.result["stdout"] == "over tls\n"

        out = subprocess.run([*CLI, "devices", "--server", f"https://127.0.0.1:{port}", "--token", api_token,
                              "--ca-file", str(pki["ca"])], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and "secure" in out.stdout
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_off_loopback_needs_tokens_and_tls(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    db = state / "server.db"
    env = tether_env(state)
    out = subprocess.run([*CLI, "server", "--host", "0.0.0.0", "--port", str(free_port()), *dbkit.server_db_args(db)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "no tokens exist" in out.stderr
    dbkit.create_tokens(dbkit.server_db(db), [("device", "d1", [])])
    out = subprocess.run([*CLI, "server", "--host", "0.0.0.0", "--port", str(free_port()), *dbkit.server_db_args(db)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "without TLS" in out.stderr
