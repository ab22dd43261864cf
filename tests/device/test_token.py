"""The device token is never on a command line and never left in the device's environment; the
device reports its sandbox. Real `tether server` and `tether device` processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from pathlib import Path

import pytest

from tests.kits.netutil import CLI, Cluster
from tether.sandbox import detect

REGISTERED = "registered as"


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sandbox_kind() -> str:
    return detect().kind


class Device:
    """A `tether device` whose output is read as a stream, so a test waits on the line it needs."""

    def __init__(self, cluster: Cluster, name: str, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            [*CLI, "device", "--server", f"ws://127.0.0.1:{cluster.port}", "--name", name,
             "--state-dir", str(cluster.state / f"dev-{name}"), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**cluster.env, **(env or {})})
        self.text = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_line(self, needle: str, timeout: float = 60) -> str:
        """Block (on the pipe, not a timer) until a line containing `needle` arrives; return it."""
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        end = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                for line in self.text.splitlines():
                    if needle in line:
                        return line
                left = end - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise AssertionError(f"no line with {needle!r} within {timeout}s; output:\n{self.text}")
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"the device exited ({self.popen.wait()}) before {needle!r}:\n{self.text}")
                self.text += chunk.decode("utf-8", "replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout is not None:
            self.popen.stdout.close()


@pytest.fixture
def devices():
    started: list[Device] = []
    yield started
    for device in reversed(started):
        device.stop()


def test_token_from_the_environment_leaves_no_trace_in_proc(cluster, devices, sandbox_kind):
    token = cluster.device_tokens["alpha"]
    device = Device(cluster, "alpha", env={"TETHER_DEVICE_TOKEN": token})
    devices.append(device)
    device.wait_line(REGISTERED)
    environ = Path(f"/proc/{device.pid}/environ").read_bytes()
    cmdline = Path(f"/proc/{device.pid}/cmdline").read_bytes()
    assert b"TETHER_STATE_DIR=" in environ, "read the device's own environment block"
    assert token.encode() not in environ
    assert token.encode() not in cmdline and b"--token" not in cmdline
    # what the kernel shows is the original block with the value zeroed (an empty value at most)
    for entry in environ.split(b"\0"):
        assert not entry.startswith(b"TETHER_DEVICE_TOKEN=") or entry == b"TETHER_DEVICE_TOKEN="
    # the server has its profile, sandbox included, as the device said at start
    assert cluster.remote.device("alpha")["profile"]["sandbox"] == sandbox_kind
    if sandbox_kind == "none":
        assert "warning: no sandbox" in device.text
    else:
        assert f"sandbox: {sandbox_kind}" in device.text


@pytest.mark.parametrize("flag", [["--token", "tdev_on-the-command-line"], ["--token=tdev_on-the-command-line"]])
def test_token_on_the_command_line_is_a_one_line_error(cluster, flag):
    out = subprocess.run([*CLI, "device", "--server", f"ws://127.0.0.1:{cluster.port}", *flag],
                         capture_output=True, text=True, env=cluster.env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    [line] = out.stderr.strip().splitlines()
    assert "--token is not accepted" in line and "--token-file" in line and "TETHER_DEVICE_TOKEN" in line


def test_token_file_registers_and_devices_show_the_sandbox(cluster, devices, tmp_path, sandbox_kind):
    private = tmp_path / "alpha.token"
    private.write_text(cluster.device_tokens["alpha"] + "\n")
    private.chmod(0o600)
    shared = tmp_path / "beta.token"
    shared.write_text(cluster.device_tokens["beta"])
    shared.chmod(0o644)
    alpha = Device(cluster, "alpha", ("--token-file", str(private)))
    beta = Device(cluster, "beta", ("--token-file", str(shared)))
    devices += [alpha, beta]
    alpha.wait_line(REGISTERED)
    warning = beta.wait_line("can be read by other users")
    assert str(shared) in warning and "0644" in warning and "chmod 600" in warning
    beta.wait_line(REGISTERED)
    assert "can be read by other users" not in alpha.text
    for device in (alpha, beta):
        cmdline = Path(f"/proc/{device.pid}/cmdline").read_bytes()
        assert b"tdev_" not in cmdline

    env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}", "TETHER_TOKEN": cluster.api_token}
    listed = subprocess.run([*CLI, "devices", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["alpha"]["sandbox"] == rows["beta"]["sandbox"] == sandbox_kind
    table = subprocess.run([*CLI, "devices"], capture_output=True, text=True, env=env, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "sandbox" in table.stdout
    assert all(sandbox_kind in line for line in table.stdout.splitlines() if "alpha" in line or "beta" in line)


def test_unreadable_or_empty_token_file_is_a_clear_error(cluster, tmp_path):
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    empty.chmod(0o600)
    for path, message in ((tmp_path / "missing.token", "cannot read token file"), (empty, "is empty")):
        out = subprocess.run([*CLI, "device", "--server", f"ws://127.0.0.1:{cluster.port}", "--token-file", str(path)],
                             capture_output=True, text=True, env=cluster.env, timeout=60)
        assert out.returncode == 2 and message in out.stderr and str(path) in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
