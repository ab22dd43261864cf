"""`tether device` refuses a mistyped start-up before anything starts: a `--server` URL it cannot use is
named in one line (its control characters escaped), exit 2, and nothing of the state directory is made.
Real `tether device` processes; no server is needed, since nothing may be reached."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.kits.netutil import CLI

USAGE_EXIT = 2


def _device(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TETHER_DEVICE_TOKEN": "not-used", "HOME": str(tmp_path)}
    return subprocess.run([*CLI, "device", *args], capture_output=True, text=True, env=env, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("url", "named"), [
    ("ws://127.0.0.1:1\x1b[2J", "'ws://127.0.0.1:1\\x1b[2J'"),
    ("ws://[::1", "'ws://[::1'"),
    ("ws://127.0.0.1:port", "'ws://127.0.0.1:port'"),
    ("ftp://127.0.0.1:1", "'ftp://127.0.0.1:1'"),
])
def test_a_server_url_it_cannot_use_is_refused_in_one_line_naming_it(tmp_path: Path, url: str, named: str) -> None:
    state = tmp_path / "state"
    out = _device(tmp_path, "--server", "ws://127.0.0.1:2", "--server", url, "--state-dir", str(state))
    assert out.returncode == USAGE_EXIT, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --server: "), out.stderr
    assert named in lines[0] and "not a usable server URL" in lines[0], out.stderr
    assert "\x1b" not in out.stderr and "Traceback" not in out.stderr
    assert not state.exists(), "the device started before refusing its URL"


def test_a_config_server_url_it_cannot_use_is_refused_the_same_way(tmp_path: Path) -> None:
    config = tmp_path / "device.yaml"
    config.write_text('server:\n  url: "ws://127.0.0.1:1\\x1b[2J"\n')
    state = tmp_path / "state"
    out = _device(tmp_path, "--config", str(config), "--state-dir", str(state))
    assert out.returncode == USAGE_EXIT, out.stderr
    assert out.stderr.startswith("error: the config's server: 'ws://127.0.0.1:1\\x1b[2J/aip' is not a usable "
                                 "server URL"), out.stderr
    assert "\x1b" not in out.stderr and not state.exists()


def test_device_key_mints_no_key_under_a_path_that_does_not_exist_and_says_what_it_made(tmp_path: Path) -> None:
    def key(state: Path, *more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "device", "key", "--state-dir", str(state), *more], capture_output=True,
                              text=True, env={**os.environ, "HOME": str(tmp_path)}, timeout=60,
                              stdin=subprocess.DEVNULL)

    typo = tmp_path / "srv-typo" / "state"
    out = key(typo)
    letters = "".join(out.stderr.split())  # the terminal's width may fold a long path anywhere
    assert out.returncode == USAGE_EXIT and "Traceback" not in out.stderr, out.stderr
    said = f"the state directory {typo} cannot be made: {typo.parent} does not exist; no key was made"
    assert "".join(said.split()) in letters, out.stderr
    assert not typo.parent.exists(), "a key was made under a path nobody asked for"
    # a new state directory in an existing one (a device's first key): made, and both are named
    fresh = tmp_path / "state"
    out = key(fresh)
    assert out.returncode == 0, out.stderr
    assert f"made {fresh}\n" in out.stderr and f"made {fresh / 'device.key'}\n" in out.stderr, out.stderr
    again = key(fresh, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["made"] == [], again.stdout
