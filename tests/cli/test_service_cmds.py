"""`tether device|server install`: the units systemd would run, verified by systemd itself
(`systemd-analyze verify`), and a device run the way its unit runs it comes back after a kill -9."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from tests.kits.netutil import CLI, Cluster, wait_for
from tether.cli.commands.setup.systemd import systemd_problem


def tether(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200", **(env or {})})


def exec_start(unit: str) -> list[str]:
    [line] = [x for x in unit.splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart=").replace("%%", "%"))


def verify(tmp_path, name: str, unit: str) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: apt-get install -y systemd")
    path = tmp_path / name
    path.write_text(unit)
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if name in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


@pytest.mark.parametrize("kind,args", [
    ("device", ["--server", "wss://fleet.example:8765", "--token-file", "/etc/tether/my laptop.token", "--tag", "lab"]),
    ("server", ["--host", "0.0.0.0", "--tls-cert", "/etc/tether/cert.pem", "--tls-key", "/etc/tether/key.pem"]),
])
@pytest.mark.parametrize("scope", ["--user", "--system"])
def test_units_verify(tmp_path, kind, args, scope):
    done = tether(kind, "install", scope, "--print", "--", *args)
    assert done.returncode == 0, done.stderr
    unit = done.stdout
    assert "Restart=always" in unit
    assert ("WantedBy=multi-user.target" if scope == "--system" else "WantedBy=default.target") in unit
    assert exec_start(unit)[-len(args):] == args  # the spaces survive systemd's word splitting
    verify(tmp_path, f"tether-{kind}.service", unit)


def test_a_unit_holds_absolute_paths_and_its_working_directory_and_refuses_a_typo(tmp_path):
    done = subprocess.run([*CLI, "device", "install", "--print", "--", "--server", "ws://127.0.0.1:1",
                           "--token-file", "keys/alpha.token", "--state-dir=state", "--tag", "lab"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert exec_start(done.stdout)[-8:] == ["device", "--server", "ws://127.0.0.1:1", "--token-file",
                                            str(tmp_path / "keys/alpha.token"), f"--state-dir={tmp_path / 'state'}",
                                            "--tag", "lab"]
    assert f"WorkingDirectory={tmp_path}" in done.stdout.splitlines()
    assert "RestartPreventExitStatus=2" in done.stdout  # a bad configuration is not restarted every 2 s
    verify(tmp_path, "tether-device.service", done.stdout)
    typo = tether("device", "install", "--user", "--", "--sever", "ws://127.0.0.1:1",
                  env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert typo.returncode == 2 and "no option --sever; did you mean --server?" in typo.stderr, typo.stderr
    assert "nothing was written" in typo.stderr and not (tmp_path / "systemd").exists() and not typo.stdout
    bad = tether("server", "install", "--print", "--", "--port", "eighty")
    assert bad.returncode == 2 and "--port" in bad.stderr and "Traceback" not in bad.stderr and not bad.stdout


def test_a_token_never_goes_into_a_unit():
    done = tether("device", "install", "--print", "--", "--server", "ws://127.0.0.1:1", "--token", "tdev_x")
    assert done.returncode == 2 and "never goes into a unit file" in done.stderr and "tdev_x" not in done.stdout
    done = tether("device", "install", "--print", "--", "--server", "ws://127.0.0.1:1",
                  env={"TETHER_DEVICE_TOKEN": "tdev_secret"})
    assert done.returncode == 2 and "--token-file" in done.stderr and "tdev_secret" not in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_without_systemd_the_unit_is_printed(tmp_path):
    problem = systemd_problem(system=False)
    if problem is None:  # a machine whose systemd runs: installing for real is not this test's business
        return
    done = tether("device", "install", "--user", "--", "--server", "ws://127.0.0.1:1",
                  env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert done.returncode == 1
    assert problem in done.stderr.replace("\n", " ") and "[Service]" in done.stdout
    assert not (tmp_path / "systemd").exists()  # nothing half-installed
    status = tether("device", "status")
    assert status.returncode == 2 and "cannot ask systemd" in status.stderr


def test_a_device_restarted_like_its_unit_reconnects(tmp_path):
    cluster = Cluster(tmp_path)
    try:
        token_file = tmp_path / "alpha.token"
        token_file.write_text(cluster.device_tokens["alpha"])
        token_file.chmod(0o600)
        done = tether("device", "install", "--print", "--", "--server", f"ws://127.0.0.1:{cluster.port}",
                      "--name", "alpha", "--token-file", str(token_file), "--state-dir", str(tmp_path / "dev"))
        argv = exec_start(done.stdout)

        def start(label: str) -> subprocess.Popen:
            log = (tmp_path / f"{label}.log").open("wb")
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=cluster.env)

        first = start("first")
        wait_for(lambda: cluster.status("alpha") in ("online", "busy"), "alpha online", 60, (first,))
        first.kill()  # what Restart=always answers: a new process with the same ExecStart
        first.wait()
        second = start("second")
        try:
            wait_for(lambda: "registered as alpha" in (tmp_path / "second.log").read_text(), "alpha back", 60,
                     (second,))
            wait_for(lambda: cluster.status("alpha") in ("online", "busy"), "alpha online again", 60, (second,))
        finally:
            second.terminate()
            second.wait(timeout=30)
    finally:
        cluster.close()


def test_device_logs_json_lines_for_log_shippers(tmp_path):
    import json

    cluster = Cluster(tmp_path)
    try:
        device = cluster.device("alpha", extra=("--log-format", "json"))
        cluster.wait_online("alpha", device)
        def registered() -> dict | None:
            for line in device.output().splitlines():
                if line.startswith("{"):
                    entry = json.loads(line)  # every log line is one JSON object
                    if entry["message"].startswith("registered as alpha"):
                        return entry
            return None
        entry = wait_for(registered, "a JSON 'registered' line", 60, (device.popen,))
        assert entry["level"] == "info" and entry["logger"] == "tether.device.link.connection"
        assert entry["ts"].endswith("Z")
        from tether.protocol.models import Command

        cluster.remote.run("alpha", [Command(tool_name="get_system_info", parameters={}),
                                     Command(tool_name="no_such_tool", parameters={})], timeout=30, early_exit=False)

        def command_lines() -> list[dict]:
            lines = [json.loads(x) for x in device.output().splitlines() if x.startswith("{")]
            return [x for x in lines if x.get("tool") in ("get_system_info", "no_such_tool")]
        ran = wait_for(lambda: len(command_lines()) == 2 and command_lines(), "one line per command", 60,
                       (device.popen,))
        assert [(x["tool"], x["status"]) for x in ran] == [("get_system_info", "success"), ("no_such_tool", "failure")]
        assert all(x["level"] == "info" and x["duration_ms"] >= 0 and x["call_id"] for x in ran)
        bad = subprocess.run([*CLI, "device", "--log-format", "xml"], capture_output=True, text=True, timeout=60,
                             env=cluster.env)
        assert bad.returncode == 2 and "--log-format must be one of plain, json" in bad.stderr
    finally:
        cluster.close()
