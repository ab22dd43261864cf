"""Real `tether server` and `tether device` processes on 127.0.0.1, driven through the REST API."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import psutil
import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import Cluster, TcpProxy, tether_env, wait_for, workspace_policy
from tether.client.rest import RemoteError, RemoteServer
from tether.protocol.models import Command, ResultStatus
from tether.server.store import Store


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def shell(cmd: str, argv: list[str], cwd: Path) -> Command:
    return Command(tool_name="shell.run", parameters={"cmd": cmd, "argv": argv, "cwd": str(cwd)})


def test_register_run_and_skip(cluster, tmp_path):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    detail = cluster.remote.device("alpha")
    assert detail["profile"]["cpu"]["cores"] >= 1
    assert any(t["name"] == "shell.run" for t in detail["profile"]["tools"])
    tools = cluster.remote.tools("alpha")
    assert {"shell.run", "read_file"} <= {t.name for t in tools}
    cmds = [shell("echo", ["one"], tmp_path), Command(tool_name="read_file", parameters={"file_path": 7}),
            shell("echo", ["three"], tmp_path)]
    events = []
    device, results = cluster.remote.run("alpha", cmds, timeout=30, on_event=events.append)
    assert device == "alpha"
    outputs = [e for e in events if e.kind == "output"]
    assert outputs and outputs[0].call_id == cmds[0].call_id and "one" in outputs[0].data["data"]
    assert [r.status for r in results] == [ResultStatus.SUCCESS, ResultStatus.FAILURE, ResultStatus.SKIPPED]
    assert [r.call_id for r in results] == [c.call_id for c in cmds]
    assert results[0].result["stdout"] == "one\n"
    assert "file_path" in results[1].error


def test_bad_no_revoked_and_mismatched_tokens_are_refused(cluster):
    bad = cluster.device("gamma", token="tdev_not-a-real-token")
    assert bad.popen.wait(timeout=60) == 3, bad.output()
    assert "unauthorized" in bad.output().lower() or "token" in bad.output().lower()
    none = cluster.start(["device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", "nobody",
                          "--state-dir", str(cluster.state / "none")], "device-none")
    env_free = none.popen.wait(timeout=60)
    assert env_free == 2 and "no device token" in none.output()
    posing = cluster.device("beta", token=cluster.device_tokens["alpha"])
    assert posing.popen.wait(timeout=60) == 3
    assert "alpha" in posing.output() and "beta" in posing.output()
    store = Store(str(dbkit.server_db(cluster.db)))
    assert store.tokens.revoke("beta") == 1
    store.close()
    revoked = cluster.device("beta")
    assert revoked.popen.wait(timeout=60) == 3
    assert cluster.status("beta") in (None, "offline")


def test_duplicate_live_device_is_refused_but_keeps_trying(cluster):
    first = cluster.device("alpha")
    cluster.wait_online("alpha", first)
    # the same device started again elsewhere: a copy of its state (key and all), since one process holds a
    # state directory alone
    copy = cluster.state / "dev-alpha-copy"
    shutil.copytree(cluster.state / "dev-alpha", copy, ignore=shutil.ignore_patterns("device.lock"))
    second = cluster.device("alpha", state_dir=copy)
    wait_for(lambda: "duplicate" in second.output().lower(), "duplicate refusal", 60, (second.popen,))
    assert second.popen.poll() is None, "a duplicate is retried, not fatal"
    _, [result] = cluster.remote.run("alpha", [Command(tool_name="get_system_info",
                                                       parameters={"info_type": "os"})], timeout=30)
    assert result.ok
    first.kill()
    wait_for(lambda: "reconnected" in second.output() or "registered as alpha" in second.output(),
             "the second device takes over", 60, (second.popen,))


def test_two_devices_in_parallel(cluster, tmp_path):
    alpha, beta = cluster.device("alpha"), cluster.device("beta")
    cluster.wait_online("alpha", alpha)
    cluster.wait_online("beta", beta)

    async def both():
        a = asyncio.to_thread(cluster.remote.run, "alpha", [shell("hostname", [], tmp_path)], timeout=30)
        b = asyncio.to_thread(RemoteServer(f"http://127.0.0.1:{cluster.port}", cluster.api_token).run, "beta",
                              [shell("echo", ["from-beta"], tmp_path)], timeout=30)
        return await asyncio.gather(a, b)

    (dev_a, [ra]), (dev_b, [rb]) = asyncio.run(both())
    assert (dev_a, dev_b) == ("alpha", "beta")
    assert ra.ok and rb.ok and rb.result["stdout"] == "from-beta\n"
    rows = {r["name"]: r for r in cluster.remote.devices()}
    assert rows["alpha"]["status"] in ("online", "busy") and rows["beta"]["status"] in ("online", "busy")


def test_kill_device_mid_command_fails_fast_and_device_comes_back(cluster, tmp_path):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    started = time.monotonic()

    async def run_and_kill():
        call = asyncio.to_thread(cluster.remote.run, "alpha", [shell("sleep", ["30"], tmp_path)], timeout=60)
        task = asyncio.ensure_future(call)
        await asyncio.to_thread(wait_for, lambda: _child_named(alpha.pid, "sleep"), "sleep started", 30)
        alpha.kill()
        return await task

    _, [result] = asyncio.run(run_and_kill())
    elapsed = time.monotonic() - started
    # the server cannot know the device died, only that it left: "outcome pending" (docs/outcomes.md)
    assert result.outcome_pending and "grace period" in (result.error or ""), result
    assert elapsed < 20, f"the caller waited {elapsed:.1f}s"
    wait_for(lambda: cluster.status("alpha") == "offline", "alpha offline", 30)
    again = cluster.device("alpha")
    cluster.wait_online("alpha", again)


def _child_named(pid: int, name: str) -> bool:
    try:
        return any(p.name() == name for p in psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return False


async def test_dropped_connection_delivers_result_exactly_once(cluster, tmp_path):
    proxy = await TcpProxy(cluster.port).start()
    live = tmp_path / "live"
    live.mkdir()
    # the sandbox captures writes until a command ends; the marks and the gate must be seen while it
    # runs, which is what live_write_roots are for (bound into the sandbox as they are)
    policy = workspace_policy(tmp_path, live_write_roots=[str(live)])
    alpha = cluster.device("alpha", port=proxy.port, extra=("--policy", str(policy)))
    await asyncio.to_thread(cluster.wait_online, "alpha", alpha)
    gate = live / "gate"
    os.mkfifo(gate)  # the script blocks reading it until the test opens the gate
    marks = live / "marks.txt"
    script = tmp_path / "wait_gate.py"
    script.write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marks)!r}).open('a').write('ran\\n')\n"
        f"pathlib.Path({str(gate)!r}).read_text()\n"
        "print('gate opened')\n")
    cmd = shell("python3", [str(script)], tmp_path)
    call = asyncio.ensure_future(asyncio.to_thread(cluster.remote.run, "alpha", [cmd], timeout=60))
    await asyncio.to_thread(wait_for, lambda: marks.exists(), "script started", 30)
    accepted = proxy.accepted
    proxy.cut()  # the connection drops; the device process and its command live on
    await asyncio.to_thread(wait_for, lambda: proxy.accepted > accepted, "device reconnects", 30)
    await asyncio.to_thread(gate.write_text, "open")
    _, [result] = await call
    await proxy.aclose()
    assert result.ok, result.error
    assert result.result["stdout"] == "gate opened\n"
    assert marks.read_text() == "ran\n", "the command ran exactly once"
    assert result.call_id == cmd.call_id


def test_api_scopes_and_errors(cluster):
    reader = RemoteServer(f"http://127.0.0.1:{cluster.port}", cluster.read_token)
    assert isinstance(reader.devices(), list)
    with pytest.raises(RemoteError, match="execute"):
        reader.run("alpha", [Command(tool_name="list_tools")])
    with pytest.raises(RemoteError, match="401"):
        RemoteServer(f"http://127.0.0.1:{cluster.port}", "nope").devices()
    with pytest.raises(RemoteError, match="device token"):
        RemoteServer(f"http://127.0.0.1:{cluster.port}", cluster.device_tokens["alpha"]).devices()
    with pytest.raises(RemoteError, match="no device named 'ghost'"):
        cluster.remote.run("ghost", [Command(tool_name="list_tools")])
    with pytest.raises(RemoteError, match="409"):
        cluster.remote.run(None, [Command(tool_name="list_tools")], requires={"gpu": True})
    import httpx

    schema = httpx.get(f"http://127.0.0.1:{cluster.port}/openapi.json").json()
    assert "/api/v1/devices/{name}/commands" in schema["paths"]


def test_cli_devices_tools_and_exec_on_a_device(cluster, tmp_path):
    alpha = cluster.device("alpha")
    cluster.wait_online("alpha", alpha)
    env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}", "TETHER_TOKEN": cluster.api_token}
    import subprocess

    from tests.kits.netutil import CLI

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120)

    listing = cli("devices")
    assert listing.returncode == 0 and "alpha" in listing.stdout and "online" in listing.stdout
    tools = cli("tools", "--device", "alpha", "--json")
    assert tools.returncode == 0 and "shell.run" in tools.stdout
    ran = cli("exec", "--device", "alpha", "shell.run", "cmd=echo", 'argv=["remote"]', f"cwd={tmp_path}", "--json")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert '"remote\\n"' in ran.stdout
    denied = cli("exec", "--device", "alpha", "shell.run", "cmd=sudo", f"cwd={tmp_path}")
    assert denied.returncode == 1 and "always-denied" in denied.stdout


def test_remote_demo_runs_green(tmp_path):
    import subprocess

    from tests.kits.netutil import CLI

    out = subprocess.run([*CLI, "demo", "--state-dir", str(tmp_path / "state")], capture_output=True,
                         text=True, env=tether_env(tmp_path / "state"), timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo finished" in out.stdout
    assert "the task ran, its failed mkdir patched by recovery" in out.stdout
    assert "the file it wrote is gone" in out.stdout
    assert os.path.exists(tmp_path / "state" / "server.db")


def test_device_from_a_config_file(cluster, tmp_path):
    token_file = tmp_path / "alpha.token"
    token_file.write_text(cluster.device_tokens["alpha"] + "\n")
    config = tmp_path / "device.yaml"
    config.write_text(
        "server:\n"
        f"  host: 127.0.0.1\n  port: {cluster.port}\n  protocol: ws\n  token_file: alpha.token\n"
        "device:\n  name: alpha\n  tags: [lab, linux-box]\n")
    proc = cluster.start(["device", "--config", str(config), "--state-dir", str(tmp_path / "dev")], "device-cfg")
    cluster.wait_online("alpha", proc)
    detail = cluster.remote.device("alpha")
    assert set(detail["tags"]) == {"lab", "linux-box"}
    device, [result] = cluster.remote.run(None, [Command(tool_name="get_system_info", parameters={"info_type": "os"})],
                                          requires={"tags": ["lab"]}, timeout=30)
    assert device == "alpha" and result.ok
